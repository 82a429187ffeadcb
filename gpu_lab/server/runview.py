"""What the lab's run view and comparison read: a run's record and the files in its run folder.

Every function here blocks (SQLite, file reads): the handlers and the live feed call them in the
extension's thread pool. A run's series come from the registry's downsampled levels
(gpu_lab.record.levels), so opening the view of a million-step run costs what the points shown
cost, not the run's length: the browser gets at most `points` points per series, each bucket's
minimum and maximum exact. The notes are the newest NOTES_KEPT, read through an index.

Series are per metric, per rank and for the mean over the ranks ("mean"): what the view draws.
NaN and infinite values are points of their series (a rank's NaN makes that step's mean NaN: a
diverging run must show); JSON has neither, so the browser gets them as null in `value`, and
each series that holds any also lists them in `nonfinite`: [[index, "NaN" | "Infinity" |
"-Infinity"], ...]. Log files are the run folder's logs/rank<N>.log and logs/supervisor.log,
read by byte offset so that a browser can follow them from where it stopped.
"""
from __future__ import annotations

import math
import os
from typing import Any

from gpu_lab.record import events as ev
from gpu_lab.record import levels, mean
from gpu_lab.record.runfolder import RunFolder, check_log_name  # noqa: F401 - the handlers' check

from .wire import json_safe, run_to_wire

DEFAULT_POINTS = 1000
MAX_POINTS = 5000
MAX_COMPARE = 64         # runs in one comparison: a whole sweep
COMPARE_POINTS = 8000    # points of one metric over every run of a comparison: what is drawn
EVENTS_LIMIT = 2000      # events per incremental answer (the rest follows in the next one)
LOG_TAIL_BYTES = 16 * 1024
LOG_CHUNK_BYTES = 64 * 1024
NOTES_KEPT = 100         # newest log/error/dropped events sent with a run
STATUSES_KEPT = 1000     # newest status events read for the ranks' pids
NOTE_KINDS = (ev.LOG, ev.ERROR, ev.DROPPED)
_NONFINITE = {float("inf"): "Infinity", float("-inf"): "-Infinity"}
MEAN = "mean"


# --- series ---------------------------------------------------------------------------------------
def series_to_wire(snapshot: Any, points: int, with_ranks: bool = True) -> dict:
    """{metric: {"0": {step, t, value}, "1": ..., "mean": ...}}, each at most `points` points, from
    a registry snapshot (Registry.series). `with_ranks=False` keeps only the mean (a comparison
    overlays runs, not their ranks)."""
    out: dict = {}
    for name, by in levels.by_metric(snapshot, points, with_ranks).items():
        out[name] = {key: _wire(*s) for key, s in by.items()}
    return out


def _wire(steps: list, times: list, values: list) -> dict[str, list]:
    out = {"step": list(steps), "t": [round(t, 3) for t in times], "value": json_safe(values)}
    odd = [[i, _NONFINITE.get(v, "NaN")] for i, v in enumerate(values) if not math.isfinite(v)]
    if odd:
        out["nonfinite"] = odd
    return out


# --- one run ----------------------------------------------------------------------------------------
def row_to_wire(registry: Any, row: dict) -> dict:
    return run_to_wire({**row, **registry.last_values(row["id"])})


def detail(registry: Any, run_id: str, points: int = DEFAULT_POINTS) -> dict | None:
    """Everything the run view opens with: the row, config, bounded series, the newest notes,
    the failure triage and the tail of each log; `seq` and each log's `to` say where to follow
    from."""
    row = registry.get_run(run_id)
    if row is None:
        return None
    snap = registry.series(run_id, points)  # what is read below stops at its seq; the feed goes on
    seq = snap.seq
    out = row_to_wire(registry, row)
    out["config"] = json_safe(row.get("config") or {})
    out["seq"] = seq
    out["series"] = series_to_wire(snap, points)
    out["notes"] = [event_to_wire(e) for e in
                    registry.last_events(run_id, NOTE_KINDS, NOTES_KEPT, upto=seq)]
    # each rank's pid (from its status events): what NVML lists on the GPUs the rank uses
    statuses = [e for e in registry.last_events(run_id, [ev.STATUS], STATUSES_KEPT, upto=seq)
                if isinstance(e["data"], dict) and isinstance(e["rank"], int) and e["rank"] >= 0]
    out["pids"] = {str(e["rank"]): e["data"]["pid"] for e in statuses
                   if isinstance(e["data"].get("pid"), int)}
    # and the host each rank ran on: a multi-node run's curves say which node
    out["hosts"] = {str(e["rank"]): e["data"]["host"] for e in statuses
                    if isinstance(e["data"].get("host"), str)}
    out["failure"] = failure(row)
    out["logs"] = [read_log(row.get("run_dir"), name, -1) for name in log_files(row.get("run_dir"))]
    return out


def events_since(registry: Any, run_id: str, after: int, limit: int = EVENTS_LIMIT,
                 upto: int | None = None) -> dict | None:
    """The run's events with seq > after (at most `limit`), its row, and whether more remain."""
    row = registry.get_run(run_id)
    if row is None:
        return None
    head = registry.last_seq(run_id) if upto is None else upto
    events = registry.events(run_id, after=after, upto=head, limit=limit)
    last = events[-1]["seq"] if events else max(after, 0)
    return {"run": row_to_wire(registry, row), "events": [event_to_wire(e) for e in events],
            "mean": live_mean(registry, row, after, events, ended=last >= head),
            "seq": last, "more": last < head}


def live_mean(registry: Any, row: dict, after: int, events: list[dict], ended: bool) -> dict:
    """The mean over ranks that `events` (registry events after seq `after`) make due, for a
    reader that has the run up to `after` (record.mean's fold, started from the record):
    {metric: {step, t, value[, nonfinite]}}, each point replacing any the reader has at its
    step. `ended`: these events reach the newest recorded, so a run that is over gives its
    steps still waiting for a rank."""
    if not events and (not ended or row.get("status") in ev.ACTIVE_STATUSES):
        return {}
    points = mean.live_points(lambda n: registry.recent_metrics(row["id"], n, after),
                              row.get("num_processes") or 1, events,
                              ended and row.get("status") not in ev.ACTIVE_STATUSES)
    return {name: _wire(*p) for name, p in points.items()}


def event_to_wire(e: dict) -> dict:
    return {"seq": e["seq"], "rank": e["rank"], "kind": e["kind"], "t": round(e["t"], 3),
            "step": ev.step_of(e), "data": json_safe(e.get("data") or {})}


def failure(row: dict) -> dict | None:
    """The triage of a failed run: each failed rank (root cause first) and what to try."""
    if row.get("status") != "failed":
        return None
    from gpu_lab.failures.triage import RunError, failures_of

    failures = failures_of(RunFolder(row["run_dir"]).read_errors()) if row.get("run_dir") else []
    report = RunError(failures, supervisor=None if failures else row.get("error"))
    return {"text": str(report) or (row.get("error") or "the run failed"),
            "headline": report.headline,  # the end notice's line (gpu_lab.record.notify's too)
            "category": report.category,
            "ranks": [json_safe({**f.to_dict(), "traceback": _last_lines(f.traceback, 30)})
                      for f in report.failures]}


def _last_lines(text: str, n: int) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-n:])


# --- logs -------------------------------------------------------------------------------------------
def log_files(run_dir: str | None) -> list[str]:
    """The run's log files: rank0.log, rank1.log, ... (by rank), then supervisor.log."""
    return RunFolder(run_dir).log_names() if run_dir else []


def log_sizes(run_dir: str | None) -> dict[str, int]:
    folder = RunFolder(run_dir or "")
    out = {}
    for name in log_files(run_dir):
        try:
            out[name] = folder.log_path(name).stat().st_size
        except OSError:
            continue
    return out


def read_log(run_dir: str | None, name: str, offset: int, upto: int | None = None,
             max_bytes: int = LOG_CHUNK_BYTES) -> dict:
    """Bytes [offset, upto) of a run's log file as text, at most max_bytes, ending at a line end
    when the chunk holds one (a line still being written waits for the next read). offset < 0:
    the last LOG_TAIL_BYTES, from a line start. `to` is where the next read starts."""
    path = RunFolder(run_dir or "").log_path(name)  # checks the name
    try:
        size = path.stat().st_size
    except OSError:
        return {"file": name, "from": 0, "to": 0, "size": 0, "text": ""}
    end = size if upto is None else min(upto, size)
    tail = offset < 0
    start = max(0, end - LOG_TAIL_BYTES) if tail else min(offset, end)
    stop = min(end, start + max_bytes)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(stop - start)
    if tail and start > 0:  # from the first whole line
        cut = data.find(b"\n")
        start, data = (start + cut + 1, data[cut + 1:]) if cut >= 0 else (start, data)
    cut = data.rfind(b"\n")
    if 0 <= cut < len(data) - 1:  # whole lines only; a chunk without any line end goes as is
        data = data[:cut + 1]
    return {"file": name, "from": start, "to": start + len(data), "size": size,
            "text": data.decode(errors="replace")}


# --- controls ---------------------------------------------------------------------------------------
def request_checkpoint(registry: Any, run_id: str) -> dict:
    """What Run.request_checkpoint() does: the control file the training loop looks for at each
    logged step; it saves a checkpoint at that step boundary."""
    row = _active_row(registry, run_id, "checkpoint")
    path = RunFolder(row["run_dir"]).request("checkpoint")  # as Run.request_checkpoint() asks
    return {"run": row_to_wire(registry, row), "requested": os.fspath(path)}


def resume(registry: Any, run_id: str) -> dict:
    """gpu_lab.attach(run_id).resume(): a new run that continues this one from its newest
    complete checkpoint. ValueError (with the library's message) when it cannot."""
    from gpu_lab.launch import PreflightError, attach_run
    from gpu_lab.train.checkpoint import CheckpointError

    row = registry.get_run(run_id)
    if row is None:
        raise KeyError(run_id)
    if row["status"] in ev.ACTIVE_STATUSES:
        raise ValueError(f"run {run_id} is still {row['status']}: stop it first (Stop saves a "
                         "checkpoint), then resume it")
    try:
        new = attach_run(run_id, registry=registry).resume()
    except (PreflightError, CheckpointError) as e:  # the user's to act on, like a ValueError
        raise ValueError(str(e)) from e
    return {"run": row_to_wire(registry, registry.get_run(new.id)), "resumed": run_id}


def _active_row(registry: Any, run_id: str, what: str) -> dict:
    row = registry.get_run(run_id)
    if row is None:
        raise KeyError(run_id)
    if row["status"] not in ev.ACTIVE_STATUSES:
        raise ValueError(f"run {run_id} is {row['status']}: only a running run can {what}")
    if not row.get("run_dir"):
        raise ValueError(f"run {run_id} has no run folder (a headless job): it cannot {what} "
                         "from JupyterLab")
    return row


# --- comparison ---------------------------------------------------------------------------------------
def compare(registry: Any, run_ids: list[str], points: int = DEFAULT_POINTS) -> dict:
    """Runs overlaid: for each metric, each run's mean over its ranks (step, seconds since the
    run started), and the config fields in which the runs differ, which name them in a legend.
    Each run is decimated to its share of COMPARE_POINTS (at most `points`): fifty runs cost
    what is drawn, not fifty times one run's view."""
    from gpu_lab.config import config_diff

    points = max(16, min(points, COMPARE_POINTS // max(1, len(run_ids))))
    rows = []
    for rid in run_ids:
        row = registry.get_run(rid)
        if row is None:
            raise KeyError(rid)
        rows.append(row)
    differ = config_diff([r.get("config") for r in rows])
    runs, metrics = [], {}
    for row in rows:
        rid, cfg = row["id"], row.get("config") or {}
        series = series_to_wire(registry.series(rid, points), points, with_ranks=False)
        t0 = row.get("started") or 0.0
        for name, by in series.items():
            s = by[MEAN]
            s["t"] = [round(t - t0, 3) for t in s["t"]]
            metrics.setdefault(name, {})[rid] = s
        label = ", ".join(f"{k}={_short(cfg.get(k))}" for k in differ) or row.get("name") or rid
        runs.append({**row_to_wire(registry, row), "label": label,
                     "differs": {k: json_safe(cfg.get(k)) for k in differ}})
    labels = [r["label"] for r in runs]
    for r in runs:  # runs alike in the fields that tell others apart: add the run's id
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({r['id']})"
    return {"runs": runs, "differ": differ, "metrics": metrics}


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."
