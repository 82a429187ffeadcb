"""The event stream: ranks report (reporter), the run's recorder keeps the record and publishes it
(recorder), subscribers follow it (receiver); events.py is the schema."""
from __future__ import annotations

from gpu_lab._lazy import lazy_api

from .events import ENV_ADDRESS, ENV_DEVICE, ENV_RUN_DIR, ENV_RUN_ID
from .history import MetricHistory, Series, decimate_minmax
from .reporter import Reporter, get_reporter, report

# the receiver and the recorder import zmq: only when asked for
__getattr__, __dir__, __all__ = lazy_api(
    __name__, {"get_receiver": ".receiver", "Receiver": ".receiver", "Recorder": ".recorder"},
    eager=["Reporter", "report", "get_reporter", "MetricHistory", "Series", "decimate_minmax",
           "ENV_ADDRESS", "ENV_DEVICE", "ENV_RUN_DIR", "ENV_RUN_ID"])
