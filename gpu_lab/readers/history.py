"""Bounded metric history: every series keeps at most a fixed number of points, forever.

When a series outgrows its capacity it is decimated to half, keeping the minimum and the maximum of
each bucket (so a loss spike stays visible) plus the first and the newest point (the record's
decimation, gpu_lab.record.decimate). A million-step run therefore costs what a few-thousand-step
run does.

It takes whatever a record holds without raising: NaN and infinite values are points like any
other (a diverging loss stays visible); a step that is not an int counts as no step, and data that
is not a dict, or a value that is not a number, is left out.
"""
from __future__ import annotations

import threading
from typing import Iterable

from ..record.decimate import minmax_indices
from ..record.events import numbers


class Series:
    """One metric of one rank: (step, wall time, value) points, bounded to `capacity`."""

    __slots__ = ("capacity", "steps", "times", "values", "count")

    def __init__(self, capacity: int = 4000) -> None:
        if capacity < 8:
            raise ValueError(f"Series capacity must be >= 8, got {capacity}")
        self.capacity = capacity
        self.steps: list[float] = []
        self.times: list[float] = []
        self.values: list[float] = []
        self.count = 0  # points ever appended

    def append(self, step: float, t: float, value: float) -> None:
        self.steps.append(step)
        self.times.append(t)
        self.values.append(value)
        self.count += 1
        if len(self.values) > self.capacity:
            self._compress()

    def _compress(self) -> None:
        keep = minmax_indices(self.values, self.capacity // 2).tolist()
        self.steps = [self.steps[i] for i in keep]
        self.times = [self.times[i] for i in keep]
        self.values = [self.values[i] for i in keep]

    def __len__(self) -> int:
        return len(self.values)

    @property
    def last(self) -> float | None:
        return self.values[-1] if self.values else None


class MetricHistory:
    """Per-rank, per-metric bounded series. Thread-safe: the receiver thread writes, anyone reads."""

    def __init__(self, capacity: int = 4000) -> None:
        self.capacity = capacity
        self._series: dict[tuple[int, str], Series] = {}
        self._lock = threading.Lock()

    def add(self, rank: int, step: int | None, t: float, data: dict) -> None:
        if type(rank) is not int:
            return
        if type(step) is not int:
            step = None
        if type(t) is not float:
            t = float(t) if type(t) is int else float("nan")
        with self._lock:
            for name, value in numbers(data):
                key = (rank, name)
                s = self._series.get(key)
                if s is None:
                    s = self._series[key] = Series(self.capacity)
                s.append(step if step is not None else s.count, t, value)

    def extend(self, events: Iterable[dict]) -> None:
        for e in events:
            self.add(e.get("rank"), e.get("step"), e.get("t"), e.get("data"))

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted({r for r, _ in self._series})

    def names(self) -> list[str]:
        with self._lock:
            return sorted({n for _, n in self._series})

    def series(self, name: str, rank: int = 0) -> tuple[list, list]:
        """(steps, values) of one metric of one rank; empty lists if nothing was reported."""
        with self._lock:
            s = self._series.get((rank, name))
            return (list(s.steps), list(s.values)) if s else ([], [])

    def times(self, name: str, rank: int = 0) -> list:
        with self._lock:
            s = self._series.get((rank, name))
            return list(s.times) if s else []

    def last(self, name: str, rank: int | None = None) -> float | None:
        """Newest value of a metric (of one rank, or of the lowest rank that has it)."""
        with self._lock:
            ranks = [rank] if rank is not None else sorted(r for r, n in self._series if n == name)
            for r in ranks:
                s = self._series.get((r, name))
                if s and s.values:
                    return s.values[-1]
            return None

    def count(self, name: str | None = None, rank: int | None = None) -> int:
        """How many points were ever reported (before decimation)."""
        with self._lock:
            return sum(s.count for (r, n), s in self._series.items()
                       if (name is None or n == name) and (rank is None or r == rank))

    def to_records(self) -> list[dict]:
        with self._lock:
            return [{"rank": r, "name": n, "step": st, "t": t, "value": v}
                    for (r, n), s in sorted(self._series.items())
                    for st, t, v in zip(s.steps, s.times, s.values)]

    def __len__(self) -> int:
        return self.count()

    def __repr__(self) -> str:
        return f"MetricHistory(ranks={self.ranks()}, names={self.names()}, points={self.count()})"
