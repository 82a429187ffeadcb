"""The event stream between training workers and the kernel (see events.py for the schema)."""
from .events import ENV_ADDRESS, ENV_DEVICE, ENV_RUN_DIR, ENV_RUN_ID
from .history import MetricHistory, Series, decimate_minmax
from .reporter import Reporter, get_reporter, report

__all__ = ["Reporter", "report", "get_reporter", "MetricHistory", "Series", "decimate_minmax",
           "get_receiver", "Receiver", "ENV_ADDRESS", "ENV_DEVICE", "ENV_RUN_DIR", "ENV_RUN_ID"]


def __getattr__(name: str):  # the receiver imports zmq: only when asked for
    if name in ("get_receiver", "Receiver"):
        from . import receiver

        return getattr(receiver, name)
    raise AttributeError(name)
