"""compare(): runs from the registry overlaid in one plotly figure, labelled by how they differ.

    gpu_lab.compare(gpu_lab.runs(name="lr-sweep"), metric="loss", x="step")

Each run is one trace (the mean over its ranks at each step, or one rank's values), decimated to a
bounded number of points that keeps each bucket's minimum and maximum. The legend names each run by
the config fields in which the runs differ. NaN and infinite values are points like others (a diverging run shows where it
diverged; plotly draws them as gaps); a step or value of the wrong type in an older record is
skipped (a point without an int step is placed by its time).
"""
from __future__ import annotations

from typing import Any, Iterable

from ..config import config_diff
from ..registry import Registry
from ..stream.history import decimate_minmax

X_AXES = ("step", "time")


def compare(runs: Iterable[Any], metric: str = "loss", x: str = "step", *, rank: int | None = None,
            max_points: int = 2000, registry: Registry | None = None):
    """A plotly Figure with `metric` of every run against `x` ("step", or "time": seconds since
    the run started). `runs`: Run handles, run ids or names, or registry rows (gpu_lab.runs())."""
    import plotly.graph_objects as go

    if x not in X_AXES:
        raise ValueError(f"compare: x must be one of {', '.join(map(repr, X_AXES))}; got {x!r}")
    reg = registry or Registry()
    rows = [_row(r, reg) for r in runs]
    if not rows:
        raise ValueError("compare: no runs given; pass Run handles, run ids or gpu_lab.runs(...)")
    differ = config_diff([r.get("config") for r in rows])
    fig = go.Figure()
    for row in rows:
        xs, ys = _series(reg, row, metric, x, rank)
        xs, ys = decimate_minmax(xs, ys, max_points) if len(xs) > max_points else (xs, ys)
        cfg = row.get("config") or {}
        label = ", ".join(f"{k}={cfg.get(k)}" for k in differ) or row.get("name") or row["id"]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label,
                                 hovertemplate=f"{row['id']}<br>{x}=%{{x}}<br>{metric}=%{{y:.4g}}"
                                               "<extra></extra>"))
    if not any(len(t.y) for t in fig.data):
        found = {name for row in rows for name in reg.summary(row["id"])}
        raise ValueError(f"compare: none of these runs reported {metric!r}; they reported: "
                         f"{', '.join(sorted(found)) or 'nothing'}")
    fig.update_layout(title=f"{metric} by {'step' if x == 'step' else 'time'}"
                            f"{' (rank %d)' % rank if rank is not None else ' (mean over ranks)'}",
                      xaxis_title="step" if x == "step" else "seconds since the run started",
                      yaxis_title=metric, legend_title_text=("differs in: " + ", ".join(differ))
                      if differ else "run", template="plotly_white")
    return fig


def _row(run: Any, reg: Registry) -> dict:
    if isinstance(run, dict) and "id" in run:
        return reg.get_run(run["id"]) or run
    if isinstance(run, str):
        return reg.find_run(run)
    run_id = getattr(run, "id", None)
    if run_id is None:
        raise TypeError(f"compare: expected Run handles, run ids or registry rows; got "
                        f"{type(run).__name__}")
    return reg.find_run(run_id)


def _series(reg: Registry, row: dict, metric: str, x: str, rank: int | None) -> tuple[list, list]:
    """(x, y) of one run: the mean over ranks per step (or one rank's points)."""
    try:
        points = reg.metrics(row["id"], metric, rank)
    except (AttributeError, TypeError):  # an older record holds a metric event whose data is
        points = _points(reg, row["id"], metric, rank)  # not a dict: read it event by event
    t0 = row.get("started") or (points[0]["t"] if points else 0.0)
    by_key: dict[Any, list[float]] = {}
    for m in points:
        value, step, t = m.get("value"), m.get("step"), m.get("t")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if x == "step" and type(step) is int:
            key = step
        elif isinstance(t, (int, float)):
            key = round(t - t0, 3)
        else:
            continue
        by_key.setdefault(key, []).append(float(value))
    keys = sorted(by_key)
    return keys, [sum(by_key[k]) / len(by_key[k]) for k in keys]


def _points(reg: Registry, run_id: str, metric: str, rank: int | None) -> list[dict]:
    return [{"step": e["step"], "t": e["t"], "value": e["data"][metric]}
            for e in reg.events(run_id, kinds=["metric"])
            if isinstance(e["data"], dict) and metric in e["data"]
            and (rank is None or e["rank"] == rank)]


__all__ = ["compare"]
