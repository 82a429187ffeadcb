"""Following a run: the history from the registry, then the live events (receiver), kept as
bounded series (history); runmetrics reads every point at full resolution."""
from __future__ import annotations

from gpu_lab._lazy import lazy_api

from ..record.decimate import decimate_minmax  # noqa: F401 - re-exported
from .history import MetricHistory, Series  # noqa: F401 - re-exported

# the receiver imports zmq: only when asked for
__getattr__, __dir__, __all__ = lazy_api(
    __name__, {"get_receiver": ".receiver", "Receiver": ".receiver"},
    eager=["MetricHistory", "Series", "decimate_minmax"])
