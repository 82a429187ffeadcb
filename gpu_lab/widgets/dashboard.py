"""Dashboard: everything about one run in one widget — status, logs and errors (RunInfo), training
curves (LivePlot) and GPU / host telemetry (GPUPanel).

    run = gpu_lab.launch(train, cfg)
    run.dashboard()                      # or gpu_lab.Dashboard(run)
    gpu_lab.Dashboard("20260101-120000-ab12cd")   # a finished run, from the registry
"""
from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import ipywidgets as W

from ..registry import Registry
from ..stream.history import MetricHistory
from .gpupanel import GPUPanel
from .liveplot import LivePlot
from .runinfo import FINAL_STATUSES, RunInfo


class FinishedRun:
    """A read-only, run-like view of a run in the registry (launched by any process, any time):
    what Dashboard needs to draw a run that has no live handle in this kernel."""

    def __init__(self, row: dict, registry: Registry) -> None:
        self.id = row["id"]
        self.name = row.get("name") or row["id"]
        self.status = row.get("status")
        self.num_processes = int(row.get("num_processes") or 0)
        self.run_dir = Path(row["run_dir"]) if row.get("run_dir") else None
        self.config = row.get("config")
        self.error = row.get("error") or None
        self.device = "cpu"
        self.pid = None
        self.dropped = 0
        self.metrics = MetricHistory()
        for m in registry.metrics(self.id):
            self.metrics.add(m["rank"], m["step"], m["t"], {m["name"]: m["value"]})
        if not self.num_processes and self.metrics.ranks():
            self.num_processes = max(self.metrics.ranks()) + 1

    def logs(self, rank: int | None = 0, tail: int | None = 50) -> str:
        if self.run_dir is None:
            return ""
        p = self.run_dir / "logs" / ("supervisor.log" if rank is None else f"rank{rank}.log")
        if not p.exists():
            return ""
        with open(p, errors="replace") as f:
            lines = collections.deque(f, maxlen=tail) if tail else f.readlines()
        return "".join(lines).rstrip("\n")

    def __repr__(self) -> str:
        return f"FinishedRun(id={self.id!r}, status={self.status!r}, num_processes={self.num_processes})"


def resolve_run(run: Any, registry: Registry | None = None) -> Any:
    """A Run handle stays as it is; a run id (str) or a registry row becomes a FinishedRun."""
    if isinstance(run, str):
        reg = registry or Registry()
        row = reg.get_run(run)
        if row is None:
            recent = [r["id"] for r in reg.list_runs(limit=5)]
            raise KeyError(f"Dashboard: no run with id {run!r} in {reg.path}; recent runs: "
                           f"{', '.join(recent) or '(none)'}")
        return FinishedRun(row, reg)
    if isinstance(run, dict) and "id" in run:
        return FinishedRun(run, registry or Registry())
    if hasattr(run, "id") and hasattr(run, "status") and hasattr(run, "metrics"):
        if (run.status in FINAL_STATUSES and isinstance(run.metrics, MetricHistory)
                and not len(run.metrics)):
            reg = registry or Registry()
            row = reg.get_run(run.id)
            if row is not None:  # e.g. a handle whose events went elsewhere: the registry has them
                return FinishedRun(row, reg)
        return run
    raise TypeError(f"Dashboard: expected a Run (from gpu_lab.launch), a run id or a registry row "
                    f"(from gpu_lab.runs()); got {type(run).__name__}")


class Dashboard(W.VBox):
    """Status, logs, errors, loss / throughput / lr curves and GPU + host telemetry of one run.

    telemetry: show the GPUPanel (default: while the run is active; a finished run has no live
    GPUs to show). stop_telemetry_at_end: the panel stops sampling when the run ends (the sampler
    thread ends with its last listener), keeping what it drew.
    """

    def __init__(self, run: Any, *, telemetry: bool | None = None,
                 stop_telemetry_at_end: bool = True, max_points: int = 2000,
                 registry: Registry | None = None) -> None:
        self.run = resolve_run(run, registry)
        live = getattr(self.run, "status", None) not in FINAL_STATUSES
        self.info = RunInfo(self.run)
        self.liveplot = LivePlot(self.run, max_points=max_points)
        show_gpu = live if telemetry is None else bool(telemetry)
        self.gpupanel = GPUPanel(pid=getattr(self.run, "pid", None) if live else None) \
            if show_gpu else None
        if self.gpupanel is not None and stop_telemetry_at_end:
            self.info.on_final(lambda _run: self.gpupanel.stop("the run ended"))
        parts = [self.info, self.liveplot]
        if self.gpupanel is not None:
            parts.append(self.gpupanel)
        super().__init__(parts)

    def close(self) -> None:
        for w in (getattr(self, n, None) for n in ("info", "liveplot", "gpupanel")):
            if w is not None:
                w.close()
        super().close()

    def __repr__(self) -> str:
        return (f"Dashboard(run={getattr(self.run, 'id', None)!r}, "
                f"status={getattr(self.run, 'status', None)!r}, "
                f"telemetry={self.gpupanel is not None})")
