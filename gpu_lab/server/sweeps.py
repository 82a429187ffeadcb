"""What the lab's side panel shows of a sweep: its runs grouped under it, and a line about it.

The runs list tags each run of a sweep with its trial (the driver names the runs with
gpu_lab.sweep.study.run_name) and its last value of the sweep's metric; beside the runs goes one
summary per sweep among them: name, metric and direction, trials done of the total, how many were
pruned, the best value and its run. The settings come from the sweep's spec file, read once per
sweep and kept; the counts from the registry's rows of that sweep: the list's own rows when it
holds every run, else one query per sweep shown. The Optuna study is not opened: its storage may be
a remote database, and the registry holds what the panel shows.
"""
from __future__ import annotations

from typing import Any

from gpu_lab.record import events as ev
from gpu_lab.sweep import study as st

from .wire import json_safe

# what the panel needs of a sweep's spec (the rest, such as the space, stays on disk)
SPEC_FIELDS = ("name", "metric", "direction", "trials", "seeds", "parallel")


def spec_of(sweep_id: str, cache: dict[str, dict]) -> dict:
    """The sweep's settings, {} for a sweep without a spec on this host; read once per sweep."""
    if sweep_id not in cache:
        try:
            spec = st.read_spec(sweep_id) if st.spec_path_exists(sweep_id) else {}
        except (OSError, ValueError):  # a spec being written or damaged: try again next time
            return {}
        cache[sweep_id] = {k: spec.get(k) for k in SPEC_FIELDS} if spec else {}
    return cache[sweep_id]


def tag_runs(wire: list[dict], rows: list[dict], specs: dict[str, dict]) -> None:
    """Each run of a sweep on the wire gets `trial`, `trial_seed` and `sweep_value` (the last
    value of the sweep's metric it reported)."""
    for out, row in zip(wire, rows):
        sweep_id = row.get("sweep")
        if not sweep_id:
            continue
        trial = st.trial_of(sweep_id, row.get("name"))
        out["trial"], out["trial_seed"] = trial if trial else (None, None)
        metric = spec_of(sweep_id, specs).get("metric")
        out["sweep_value"] = json_safe(_value(row, metric))


def summaries(registry: Any, rows: list[dict], complete: bool,
              specs: dict[str, dict]) -> dict[str, dict]:
    """{sweep id: summary} for each sweep among `rows` (registry rows, newest first).
    `complete`: the rows are every run of the registry, so no sweep needs a query of its own."""
    out = {}
    for sweep_id in dict.fromkeys(r["sweep"] for r in rows if r.get("sweep")):
        mine = rows if complete else registry.list_runs(name=sweep_id)
        out[sweep_id] = summary(sweep_id, spec_of(sweep_id, specs),
                                [r for r in mine if r.get("sweep") == sweep_id])
    return out


def summary(sweep_id: str, spec: dict, rows: list[dict]) -> dict:
    """A sweep's line in the panel. A trial is done when all its runs ended; its value is the mean
    of its runs' last values when all succeeded (what the driver tells Optuna), so `best` is the
    study's best trial."""
    metric, maximize = spec.get("metric"), spec.get("direction", "maximize") != "minimize"
    trials: dict[Any, list[dict]] = {}
    for r in rows:
        t = st.trial_of(sweep_id, r.get("name"))
        trials.setdefault(t[0] if t else r["id"], []).append(r)
    done = pruned = active = 0
    best = best_run = None
    for runs in trials.values():
        statuses = [r["status"] for r in runs]
        active += any(s in ev.ACTIVE_STATUSES for s in statuses)
        pruned += "pruned" in statuses
        if any(s in ev.ACTIVE_STATUSES for s in statuses):
            continue
        done += 1
        values = [_value(r, metric) for r in runs]
        if all(s == "succeeded" for s in statuses) and all(v is not None for v in values):
            value = sum(values) / len(values)
            if best is None or (value > best if maximize else value < best):
                best, best_run = value, runs[-1]["id"]  # rows are newest first: seed 0 is last
    return {"id": sweep_id, "name": spec.get("name") or sweep_id, "metric": metric,
            "direction": spec.get("direction"), "trials": spec.get("trials"),
            "seeds": spec.get("seeds") or 1, "started": len(trials), "done": done,
            "active": active, "pruned": pruned, "best": json_safe(best), "best_run": best_run}


def _value(row: dict, metric: str | None) -> float | None:
    v = (row.get("summary") or {}).get(metric) if metric else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
