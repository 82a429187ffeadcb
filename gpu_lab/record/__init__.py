"""The record of a run: ranks report (reporter), the run's recorder checks each event and keeps
it (recorder), in the registry (SQLite) with its downsampled levels; events.py is the contract and
the wire format, channel.py the run's private CURVE keys."""
from __future__ import annotations

from gpu_lab._lazy import lazy_api

from .events import ENV_ADDRESS, ENV_DEVICE, ENV_RUN_DIR, ENV_RUN_ID  # noqa: F401 - re-exported
from .reporter import Reporter, get_reporter, report  # noqa: F401 - re-exported

# the recorder imports zmq: only when asked for
__getattr__, __dir__, __all__ = lazy_api(
    __name__, {"Recorder": ".recorder"},
    eager=["Reporter", "report", "get_reporter", "ENV_ADDRESS", "ENV_DEVICE", "ENV_RUN_DIR",
           "ENV_RUN_ID"])
