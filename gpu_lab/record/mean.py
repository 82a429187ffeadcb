"""The mean over ranks of a metric: one definition, for every place that draws it.

The mean at a step is over the ranks that reported that step, stamped with the newest of their
times; a rank's NaN or infinity makes the step's mean non-finite (a diverging rank must show).
Two forms of the same rule:

- at rest, `over_ranks`: from each rank's (steps, times, values) arrays. Exact per step when
  every series is raw; when any was decimated (a snapshot's coarser level, a widget's bounded
  history), each rank's points are interpolated at the union of their steps, within that rank's
  range, so a spike of one rank still shows at its step. The registry's snapshots
  (record.levels) and the notebook's LivePlot use it.
- live, `Fold`: metric events in seq order in, (metric, step, time, mean) out, in step order. A step
  goes once every rank reported it, or once a step `WINDOW` steps newer arrived (a rank that
  dropped a report must not hold the mean back); a report for a step already given re-gives it
  with the new mean, and a reader replaces the point it has at that step (a report more than
  KEEP windows late changes nothing shown until the view is opened again). `live_points` starts a
  fold where a reader stands (from the record's newest metric events up to that seq), so the
  server says the mean to every browser and no browser computes one (server.feeds, the run
  view's polling).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

WINDOW = 16  # steps a partial step waits for its missing ranks
KEEP = 2     # windows a given step is kept for a late report to change it


def over_ranks(series: Sequence[tuple[Any, Any, Any]], exact: bool) -> tuple[Any, Any, Any]:
    """(steps, times, values) float arrays of the mean over ranks, from one (steps, times, values)
    per rank. `exact`: every series holds all its points (a step without a number, NaN, is
    left out); else interpolate each rank's points at the union of steps."""
    import numpy as np

    arrays = []
    for s in series:
        st, ts, vs = (np.asarray(a, dtype=float) for a in s)
        n = min(len(st), len(ts), len(vs))
        st, ts, vs = st[:n], ts[:n], vs[:n]
        keep = np.isfinite(st)
        if keep.any():
            arrays.append((st[keep], ts[keep], vs[keep]))
    if not arrays:
        empty = np.empty(0)
        return empty, empty, empty
    if exact:
        st, ts, vs = (np.concatenate([a[k] for a in arrays]) for k in range(3))
        grid, at = np.unique(st, return_inverse=True)
        n = np.bincount(at, minlength=len(grid))
        values = np.bincount(at, weights=vs, minlength=len(grid)) / n
        times = np.full(len(grid), -np.inf)
        np.maximum.at(times, at, ts)
        return grid, times, values
    grid = np.unique(np.concatenate([a[0] for a in arrays]))
    total, n, times = np.zeros(len(grid)), np.zeros(len(grid)), np.zeros(len(grid))
    for xs, ts, vs in arrays:
        order = np.argsort(xs, kind="stable")
        xs, ts, vs = xs[order], ts[order], vs[order]
        inside = (grid >= xs[0]) & (grid <= xs[-1])  # no extrapolation past a rank's data
        total[inside] += np.interp(grid[inside], xs, vs)
        times[inside] = np.maximum(times[inside], np.interp(grid[inside], xs, ts))
        n[inside] += 1
    ok = n > 0
    return grid[ok], times[ok], total[ok] / n[ok]


class Fold:
    """The mean over `ranks` ranks, live (the module's docstring has the rule)."""

    def __init__(self, ranks: int, window: int = WINDOW) -> None:
        self.ranks = max(1, int(ranks))
        self.window = window
        self._open: dict[str, dict[float, list]] = {}   # metric -> step -> [sum, n, t]
        self._given: dict[str, dict[float, list]] = {}  # the newest steps already given
        self._newest: dict[str, float] = {}

    def add(self, step: Any, t: float, data: Any) -> list[tuple[str, float, float, float]]:
        """One metric event's numbers; the points that are now due."""
        if not _is_step(step) or not isinstance(data, dict):
            return []
        out: list = []
        for name, v in data.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            given = self._given.setdefault(name, {})
            if step in given:  # a late report: the step again, with its new mean
                acc = given[step]
                _into(acc, v, t)
                out.append((name, step, acc[2], acc[0] / acc[1]))
                continue
            opened = self._open.setdefault(name, {})
            if step not in opened and step < self._newest.get(name, step) - KEEP * self.window:
                continue  # too late to change what is shown: the record's next snapshot has it
            acc = opened.setdefault(step, [0.0, 0, t])
            _into(acc, v, t)
            self._newest[name] = max(self._newest.get(name, step), step)
            self._due(name, out, everything=False)
        return out

    def flush(self) -> list[tuple[str, float, float, float]]:
        """The run ended: every open step goes, with the ranks that reported it."""
        out: list = []
        for name in list(self._open):
            self._due(name, out, everything=True)
        return out

    def _due(self, name: str, out: list, everything: bool) -> None:
        steps, given = self._open.get(name, {}), self._given.setdefault(name, {})
        newest = self._newest.get(name, 0)
        for step in sorted(steps):
            acc = steps[step]
            if not everything and acc[1] < self.ranks and step >= newest - self.window:
                break
            del steps[step]
            given[step] = acc
            out.append((name, step, acc[2], acc[0] / acc[1]))
        for step in [s for s in given if s < newest - KEEP * self.window]:
            del given[step]


def _into(acc: list, v: float, t: float) -> None:
    acc[0] += v  # NaN or infinity stays in the sum: the step's mean shows it
    acc[1] += 1
    acc[2] = max(acc[2], t)


def _is_step(step: Any) -> bool:
    return (not isinstance(step, bool) and isinstance(step, (int, float))
            and math.isfinite(step))


def live_points(recent: Callable[[int], list[dict]], ranks: int, events: Iterable[dict],
                ended: bool) -> dict[str, tuple[list, list, list]]:
    """The mean points due after `events` (metric events, seq order) for a reader that already
    has everything before them: `recent(limit)` gives the record's newest metric events before
    them, oldest first, which start the fold (their own points are the reader's already).
    `ended`: the run is over and these events are its last, so every open step goes too.
    {metric: (steps, times, values)}."""
    fold = Fold(ranks)
    # enough of the newest reports to hold every step still open or kept, at a few metric events
    # per rank and step
    for e in recent(4 * fold.ranks * (KEEP * fold.window + 2)):
        fold.add(e.get("step"), e.get("t", 0.0), e.get("data"))
    out: dict[str, tuple[list, list, list]] = {}
    points = [p for e in events if e.get("kind", "metric") == "metric"
              for p in fold.add(e.get("step"), e.get("t", 0.0), e.get("data"))]
    if ended:
        points += fold.flush()
    for name, step, t, value in points:
        steps, times, values = out.setdefault(name, ([], [], []))
        steps.append(int(step) if float(step).is_integer() else step)
        times.append(t)
        values.append(value)
    return out


__all__ = ["WINDOW", "Fold", "live_points", "over_ranks"]
