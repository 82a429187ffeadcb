"""What the lab's run view and comparison read: a run's record and the files in its run folder.

Every function here blocks (SQLite, file reads): the handlers and the live feed call them in the
extension's thread pool. A run's history is read in pages and folded into bounded series as it is
read, so opening the view of a million-step run costs the server a scan, not a million points in
memory, and the browser gets at most `points` points per series, each bucket's minimum and maximum
kept (gpu_lab.stream.history).

Series are per metric, per rank and for the mean over the ranks at each step ("mean"): what the
view draws. NaN and infinite values are points of their series (a rank's NaN makes that step's
mean NaN: a diverging run must show); JSON has neither, so the browser gets them as null in
`value`, and each series that holds any also lists them in `nonfinite`: [[index, "NaN" |
"Infinity" | "-Infinity"], ...]. A step that is not an int (an older record) counts as none. Log files are the run folder's logs/rank<N>.log and logs/supervisor.log, read by byte
offset so that a browser can follow them from where it stopped.
"""
from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from gpu_lab.stream import events as ev
from gpu_lab.stream.history import MetricHistory

from .wire import json_safe, run_to_wire

DEFAULT_POINTS = 1000
MAX_POINTS = 5000
PAGE = 5000              # events per registry read while folding a history
EVENTS_LIMIT = 2000      # events per incremental answer (the rest follows in the next one)
LOG_TAIL_BYTES = 16 * 1024
LOG_CHUNK_BYTES = 64 * 1024
NOTES_KEPT = 100         # newest log/error/dropped events sent with a run
NOTE_KINDS = (ev.LOG, ev.ERROR, ev.DROPPED)
_NONFINITE = {float("inf"): "Infinity", float("-inf"): "-Infinity"}
LOG_NAME = re.compile(r"^(rank\d{1,5}|supervisor)\.log$")
MEAN = "mean"


# --- series ---------------------------------------------------------------------------------------
class MeanByStep:
    """The mean over ranks of each metric at each step, folded as events arrive.

    Means leave in step order: the oldest open step goes once every rank reported it, or once a
    step `window` steps newer has arrived (a rank that dropped a report must not hold the mean
    back forever). Ranks report nearly in step, so few steps are open and memory stays bounded."""

    def __init__(self, ranks: int, sink: MetricHistory, window: int = 16) -> None:
        self.ranks = max(1, ranks)
        self.sink = sink
        self.window = window
        self._open: dict[str, dict[int, list[float]]] = {}  # name -> step -> [sum, n, t]
        self._newest: dict[str, int] = {}

    def add(self, step: int | None, t: float, data: dict) -> None:
        if type(step) is not int or not isinstance(t, (int, float)):
            return
        for name, v in ev.numbers(data):
            steps = self._open.setdefault(name, {})
            acc = steps.setdefault(step, [0.0, 0, t])
            acc[0] += v
            acc[1] += 1
            acc[2] = max(acc[2], t)
            self._newest[name] = max(self._newest.get(name, step), step)
            self._emit(name)

    def _emit(self, name: str, everything: bool = False) -> None:
        steps = self._open[name]
        while steps:
            first = min(steps)
            total, n, t = steps[first]
            if not (everything or n >= self.ranks or first < self._newest[name] - self.window):
                return
            del steps[first]
            self.sink.add(0, first, t, {name: total / n})

    def flush(self) -> None:
        for name in self._open:
            self._emit(name, everything=True)

    def pending(self) -> dict[str, list[list[float]]]:
        """The steps still open: {metric: [[step, sum, n, t], ...]}, for a reader that goes on
        folding the run's next events (the run view)."""
        return {name: [[step, *acc] for step, acc in sorted(steps.items())]
                for name, steps in self._open.items() if steps}


def metric_pages(registry: Any, run_id: str, upto: int) -> Iterator[dict]:
    """A run's metric events up to seq `upto`, read PAGE at a time."""
    after = 0
    while after < upto:
        page = registry.events(run_id, after=after, upto=upto, kinds=[ev.METRIC], limit=PAGE)
        if not page:
            return
        yield from page
        after = page[-1]["seq"]


def fold_series(events: Iterable[dict], ranks: int, points: int, with_ranks: bool = True,
                open_means: dict | None = None) -> dict[str, dict[str, dict[str, list]]]:
    """{metric: {"0": {step, t, value}, "1": ..., "mean": ...}}, each at most `points` points.
    `with_ranks=False` keeps only the mean (a comparison overlays runs, not their ranks). Steps
    whose mean still waits for a rank go into `open_means` when it is given (a live run),
    else into the mean as they are."""
    cap = max(8, points)
    per_rank, means = MetricHistory(capacity=cap), MetricHistory(capacity=cap)
    mean = MeanByStep(ranks, means)
    for e in events:
        if with_ranks:
            per_rank.add(e.get("rank"), e.get("step"), e.get("t"), e.get("data"))
        mean.add(e.get("step"), e.get("t"), e.get("data"))
    if open_means is None:
        mean.flush()
    else:
        open_means.update(mean.pending())
    out: dict[str, dict[str, dict[str, list]]] = {}
    sources = [(MEAN, means, 0)] + ([(str(r), per_rank, r) for r in per_rank.ranks()]
                                    if with_ranks else [])
    for key, hist, rank in sources:
        for name in hist.names():
            steps, values = hist.series(name, rank)
            if not steps:
                continue
            out.setdefault(name, {})[key] = _bounded(steps, hist.times(name, rank), values, points)
    return out


def _bounded(steps: list, times: list, values: list, points: int) -> dict[str, list]:
    """At most `points` points, each bucket's min and max kept (the history holds up to twice)."""
    if len(values) > points:
        from gpu_lab.stream.history import decimate_minmax

        keep, _ = decimate_minmax(list(range(len(values))), values, max(4, points))
        steps, times, values = ([a[i] for i in keep] for a in (steps, times, values))
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
    seq = registry.last_seq(run_id)  # first: what is read below stops here, the feed goes on
    out = row_to_wire(registry, row)
    out["config"] = json_safe(row.get("config") or {})
    out["seq"] = seq
    pending: dict | None = {} if row["status"] in ev.ACTIVE_STATUSES else None
    out["series"] = fold_series(metric_pages(registry, run_id, seq),
                                int(row.get("num_processes") or 1), points, open_means=pending)
    out["mean_open"] = pending or {}
    out["notes"] = [event_to_wire(e) for e in
                    registry.events(run_id, upto=seq, kinds=NOTE_KINDS)[-NOTES_KEPT:]]
    # each rank's pid (its first status event): what NVML lists on the GPUs the rank uses
    out["pids"] = {str(e["rank"]): e["data"]["pid"]
                   for e in registry.events(run_id, upto=seq, kinds=[ev.STATUS])
                   if isinstance(e["data"], dict) and isinstance(e["data"].get("pid"), int)
                   and isinstance(e["rank"], int) and e["rank"] >= 0}
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
            "seq": last, "more": last < head}


def event_to_wire(e: dict) -> dict:
    return {"seq": e["seq"], "rank": e["rank"], "kind": e["kind"], "t": round(e["t"], 3),
            "step": ev.step_of(e), "data": json_safe(e.get("data") or {})}


def failure(row: dict) -> dict | None:
    """The triage of a failed run: each failed rank (root cause first) and what to try."""
    if row.get("status") != "failed":
        return None
    from gpu_lab.launch.triage import RankFailure, RunError

    failures = []
    errors = Path(row["run_dir"]) / "errors" if row.get("run_dir") else None
    if errors is not None and errors.is_dir():
        import json

        for p in sorted(errors.glob("rank*.json")):
            try:
                failures.append(RankFailure.from_dict(json.loads(p.read_text())))
            except (OSError, ValueError, TypeError):
                continue
    report = RunError(failures, supervisor=None if failures else row.get("error"))
    return {"text": str(report) or (row.get("error") or "the run failed"),
            "category": report.category,
            "ranks": [json_safe({**f.to_dict(), "traceback": _last_lines(f.traceback, 30)})
                      for f in report.failures]}


def _last_lines(text: str, n: int) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-n:])


# --- logs -------------------------------------------------------------------------------------------
def log_files(run_dir: str | None) -> list[str]:
    """The run's log files: rank0.log, rank1.log, ... (by rank), then supervisor.log."""
    d = Path(run_dir) / "logs" if run_dir else None
    if d is None or not d.is_dir():
        return []
    names = [p.name for p in d.iterdir() if LOG_NAME.match(p.name)]
    return sorted(names, key=lambda n: (n == "supervisor.log", len(n), n))


def log_sizes(run_dir: str | None) -> dict[str, int]:
    d = Path(run_dir or "") / "logs"
    out = {}
    for name in log_files(run_dir):
        try:
            out[name] = (d / name).stat().st_size
        except OSError:
            continue
    return out


def check_log_name(name: str) -> str:
    if not isinstance(name, str) or not LOG_NAME.match(name):
        raise ValueError(f"log file: got {str(name)[:80]!r}; accepted: rank<N>.log or "
                         "supervisor.log")
    return name


def read_log(run_dir: str | None, name: str, offset: int, upto: int | None = None,
             max_bytes: int = LOG_CHUNK_BYTES) -> dict:
    """Bytes [offset, upto) of a run's log file as text, at most max_bytes, ending at a line end
    when the chunk holds one (a line still being written waits for the next read). offset < 0:
    the last LOG_TAIL_BYTES, from a line start. `to` is where the next read starts."""
    check_log_name(name)
    path = Path(run_dir or "") / "logs" / name
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
    path = Path(row["run_dir"]) / "control" / "checkpoint"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(time.time()))
    return {"run": row_to_wire(registry, row), "requested": os.fspath(path)}


def resume(registry: Any, run_id: str) -> dict:
    """gpu_lab.attach(run_id).resume(): a new run that continues this one from its newest
    complete checkpoint. ValueError (with the library's message) when it cannot."""
    from gpu_lab.launch import PreflightError, attach
    from gpu_lab.train.checkpoint import CheckpointError

    row = registry.get_run(run_id)
    if row is None:
        raise KeyError(run_id)
    if row["status"] in ev.ACTIVE_STATUSES:
        raise ValueError(f"run {run_id} is still {row['status']}: stop it first (Stop saves a "
                         "checkpoint), then resume it")
    try:
        new = attach(run_id, registry=registry).resume()
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
    run started), and the config fields in which the runs differ, which name them in a legend."""
    from gpu_lab.config import config_diff

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
        seq = registry.last_seq(rid)
        series = fold_series(metric_pages(registry, rid, seq), int(row.get("num_processes") or 1),
                             points, with_ranks=False)
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
