"""Dashboard: everything about one run in one widget — status, logs and errors (RunInfo), training
curves (LivePlot) and GPU / host telemetry (GPUPanel).

    run = gpu_lab.launch(train, cfg)
    gpu_lab.Dashboard(run)
    gpu_lab.Dashboard("20260101-120000-ab12cd")   # any run of this host, live or finished

It reads a Run handle (gpu_lab.launch.run) and never the other way round: the handle is headless
and knows none of its views.
"""
from __future__ import annotations

from typing import Any

import ipywidgets as W

from ..record.registry import Registry
from .gpupanel import GPUPanel
from .liveplot import LivePlot
from .runinfo import FINAL_STATUSES, RunInfo


def resolve_run(run: Any, registry: Registry | None = None) -> Any:
    """A Run handle stays as it is; a run id or name (str) or a registry row (from gpu_lab.runs())
    becomes an attached Run: its recorded history, then its live events if it is still going."""
    from ..launch.run import attach_run

    if isinstance(run, str):
        try:
            return attach_run(run, registry)
        except KeyError as e:
            raise KeyError(f"Dashboard: {e.args[0]}") from None
    if isinstance(run, dict) and "id" in run:
        return attach_run(run["id"], registry)
    if hasattr(run, "id") and hasattr(run, "status") and hasattr(run, "metrics"):
        return run
    raise TypeError(f"Dashboard: expected a Run (from gpu_lab.launch or gpu_lab.attach), a run id "
                    f"or a registry row (from gpu_lab.runs()); got {type(run).__name__}")


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
