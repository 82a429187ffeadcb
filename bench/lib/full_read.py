"""The full read that opening a run cost before the registry kept downsampled levels: kept here as
the benchmark's method (bench/attach_scale.py), not in the package.

`old_attach` is the old gpu_lab.attach: every recorded event of the run applied to a Run handle.
`old_detail` is the old run view's answer: the run's whole metric history read in pages and folded
into bounded series (`fold_series`, `MeanByStep`), and its notes read by filtering every event.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from gpu_lab.server.wire import json_safe
from gpu_lab.record import events as ev
from gpu_lab.readers.history import MetricHistory

PAGE = 5000
MEAN = "mean"


def old_attach(run_id: str, registry: Any) -> Any:
    """A Run handle with every recorded event applied (the old `attach`, without following)."""
    from gpu_lab.launch.run import Run

    run = Run._from_row(registry.find_run(run_id), registry)
    events = registry.events(run.id, after=0)
    if events:
        run._on_events(events)
    return run


def old_detail(registry: Any, run_id: str, points: int = 1000) -> dict:
    """The old run view's series, notes and pids (the row, logs and triage cost the same now)."""
    from gpu_lab.server.runview import NOTE_KINDS, NOTES_KEPT, event_to_wire

    row = registry.get_run(run_id)
    seq = registry.last_seq(run_id)
    pending: dict | None = {} if row["status"] in ev.ACTIVE_STATUSES else None
    out = {"seq": seq, "series": fold_series(metric_pages(registry, run_id, seq),
                                             int(row.get("num_processes") or 1), points,
                                             open_means=pending)}
    out["notes"] = [event_to_wire(e) for e in
                    registry.events(run_id, upto=seq, kinds=NOTE_KINDS)[-NOTES_KEPT:]]
    out["pids"] = {str(e["rank"]): e["data"]["pid"]
                   for e in registry.events(run_id, upto=seq, kinds=[ev.STATUS])
                   if e["rank"] >= 0 and isinstance(e["data"].get("pid"), int)}
    return out


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
        if step is None:
            return
        for name, v in data.items():
            if not _is_number(v):
                continue
            steps = self._open.setdefault(name, {})
            acc = steps.setdefault(step, [0.0, 0, t])
            acc[0] += float(v)
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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


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
            per_rank.add(e["rank"], e.get("step"), e["t"], e["data"])
        mean.add(e.get("step"), e["t"], e["data"])
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
        from gpu_lab.record.decimate import decimate_minmax

        keep, _ = decimate_minmax(list(range(len(values))), values, max(4, points))
        steps, times, values = ([a[i] for i in keep] for a in (steps, times, values))
    return {"step": list(steps), "t": [round(t, 3) for t in times], "value": json_safe(values)}


