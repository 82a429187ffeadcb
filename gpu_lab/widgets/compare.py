"""compare(): runs from the registry overlaid in one plotly figure, labelled by how they differ.

    gpu_lab.compare(gpu_lab.runs(name="lr-sweep"), metric="loss", x="step")

Each run is one trace (the mean over its ranks, or one rank's values) of at most `max_points`
points, read from the registry's downsampled levels: each bucket's minimum and maximum are exact,
and the cost is that of the points drawn, not of the run's length. The legend names each run by
the config fields in which the runs differ. NaN and infinite values are points like others (a
diverging run shows where it diverged; plotly draws them as gaps).
"""
from __future__ import annotations

from typing import Any, Iterable

from ..config import config_diff
from ..record.registry import Registry
from ..record import levels

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
        xs, ys = _series(reg, row, metric, x, rank, max_points)
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


def _series(reg: Registry, row: dict, metric: str, x: str, rank: int | None,
            points: int) -> tuple[list, list]:
    """(x, y) of one run: the mean over ranks (or one rank's points), at most `points` points, from
    the registry's downsampled levels (each bucket's min and max exact)."""
    snap = reg.series(row["id"], points, names=[metric],
                      ranks=None if rank is None else [rank])
    t0 = row.get("started") or 0.0
    if rank is None:
        ps = list(snap.series.values())
        steps, times, values = levels.mean_of_ranks(ps, points)
        if x == "step":  # a point without a step (an older record) is placed by its time
            for p in ps:
                if p.stepped is not None and not p.stepped.all():
                    steps += [round(t - t0, 3) for t in p.env[1][~p.stepped].tolist()]
                    values += p.env[2][~p.stepped].tolist()
    else:
        p = snap.series.get((rank, metric))
        steps, times, values = (p.steps, p.times, p.values) if p else ([], [], [])
    if x == "step":
        pairs = sorted(zip(steps, values), key=lambda a: a[0])
    else:
        pairs = sorted(zip((round(t - t0, 3) for t in times), values), key=lambda a: a[0])
    return [a for a, _ in pairs], [b for _, b in pairs]


__all__ = ["compare"]
