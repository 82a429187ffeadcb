"""gpu_lab.widgets — views only, no training logic: LaunchPanel, LivePlot, GPUPanel, Dashboard.

Every view is fed from a background thread (the event receiver's tick, the telemetry sampler) and
only sets widget traits or calls `batch_update()` there, at most 4 times a second.
"""
from .dashboard import Dashboard, FinishedRun
from .gpupanel import GPUPanel
from .launchpanel import LaunchPanel
from .liveplot import LivePlot
from .runinfo import RunInfo
from .throttle import Flusher, Throttle

__all__ = ["Dashboard", "FinishedRun", "GPUPanel", "LaunchPanel", "LivePlot", "RunInfo",
           "Flusher", "Throttle"]
