"""A run's metrics as a Run handle holds them: a bounded in-memory history, and the full record one
call away.

`RunMetrics` is the MetricHistory of a Run (what the dashboard draws): an attach seeds it from the
registry's downsampled levels (at most ATTACH_POINTS points per series, each bucket's min and max
exact), and the live events extend it. `frame()` and `to_csv()` read every point at full resolution
from the registry's event log, a page at a time: the CSV's memory is bounded by the page, the
DataFrame's by its own size.
"""
from __future__ import annotations

import csv
import os
from typing import Any

from .history import MetricHistory, Series

ATTACH_POINTS = 2000   # the dashboard's default max_points: what an attach reads per series
PAGE = 50_000          # events per registry read for the full-resolution exports
COLUMNS = ("seq", "rank", "step", "t", "name", "value")


class RunMetrics(MetricHistory):
    """MetricHistory of one recorded run, with `frame()` and `to_csv()` at full resolution."""

    def __init__(self, registry: Any, run_id: str, capacity: int = 4000) -> None:
        super().__init__(capacity)
        self._registry = registry
        self._run_id = run_id

    def seed(self, snapshot: Any) -> None:
        """Start each series from a registry snapshot (gpu_lab.record.levels.read), keeping its
        true point count; live events then extend it."""
        with self._lock:
            for (rank, name), p in snapshot.series.items():
                s = Series(self.capacity)
                s.steps, s.times, s.values = list(p.steps), list(p.times), list(p.values)
                s.count = p.count
                self._series[(rank, name)] = s

    def pages(self, name: str | None = None, rank: int | None = None, page: int = PAGE):
        """Every recorded point as pages of (seq, rank, step, t, name, value) tuples."""
        return self._registry.metric_pages(self._run_id, page=page, name=name, rank=rank)

    def frame(self, name: str | None = None, rank: int | None = None) -> Any:
        """A pandas DataFrame of every recorded point (columns seq, rank, step, t, name, value),
        in the order reported; `name` / `rank` keep one metric / one rank."""
        import pandas as pd

        parts = [pd.DataFrame.from_records(p, columns=COLUMNS) for p in self.pages(name, rank)]
        if not parts:
            return pd.DataFrame({c: pd.Series(dtype=d) for c, d in zip(
                COLUMNS, ("int64", "int64", "float64", "float64", "object", "float64"))})
        df = pd.concat(parts, ignore_index=True)
        df["name"] = df["name"].astype("category")
        return df

    def to_csv(self, path: str | os.PathLike, name: str | None = None,
               rank: int | None = None) -> int:
        """Write every recorded point to a CSV file (header seq,rank,step,t,name,value), a page at
        a time; returns the number of points written."""
        n = 0
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for p in self.pages(name, rank):
                w.writerows(("" if c is None else repr(c) if isinstance(c, float) else c
                             for c in row) for row in p)
                n += len(p)
        return n
