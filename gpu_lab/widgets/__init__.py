"""gpu_lab.widgets — views only, no training logic: LaunchPanel, LivePlot, GPUPanel, Dashboard,
SweepView (a sweep's trials), and compare() (runs from the registry overlaid in one figure).

Every view is fed from a background thread (the event receiver's tick, the telemetry sampler) and
only sets widget traits or calls `batch_update()` there, at most 4 times a second.
"""
from .compare import compare
from .dashboard import Dashboard
from .gpupanel import GPUPanel
from .launchpanel import LaunchPanel
from .liveplot import LivePlot
from .runinfo import RunInfo
from .sweepview import SweepView
from .throttle import Flusher, Throttle

__all__ = ["Dashboard", "compare", "GPUPanel", "LaunchPanel", "LivePlot", "RunInfo", "SweepView",
           "Flusher", "Throttle"]
