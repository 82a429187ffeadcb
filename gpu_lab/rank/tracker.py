"""gpu_lab's accelerate tracker: `accelerator.log({...}, step=s)` lands in the run's record.

In ranks that gpu_lab launched it joins every Accelerator by itself (gpu_lab.rank.adopt); elsewhere
name it: `Accelerator(log_with=gpu_lab.Tracker())`, or `log_with="gpu_lab"` where accelerate has
`register_tracker_class` (1.15 and later; importing this module registers the name). accelerate
logs on the main process only, so these metrics are rank 0's: `gpu_lab.report()` records every
rank. `init_trackers(config=...)` becomes the run's config (shown in the run view). Outside a run
that gpu_lab started (`accelerate launch`, torchrun, `python train.py`), the tracker records the
run itself, from rank 0, into the registry (gpu_lab.rank.standalone): the lab lists it as any
other, and `gpu_lab.attach` follows it.
"""
from __future__ import annotations

import math
from typing import Any

from accelerate.tracking import GeneralTracker

from ..record import reporter as rep

PLAIN = (bool, int, float, str, type(None))


class Tracker(GeneralTracker):
    """accelerate's GeneralTracker for gpu_lab's record. A step of None is the step after the
    last one logged (0 first), as W&B counts."""

    name = "gpu_lab"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str | None = None, **_kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name  # accelerate passes init_trackers' project_name
        self._next = 0
        self._own: Any = None  # a record of its own, outside a run gpu_lab started

    @property
    def tracker(self) -> rep.Reporter:
        """What gpu_lab records through: this process's Reporter."""
        return rep.get_reporter()

    def start(self) -> None:
        """In a run gpu_lab started, nothing to open: the rank's Reporter is the channel.
        Elsewhere the run is recorded from here (gpu_lab.rank.standalone)."""
        import os

        from ..record import events as ev

        if self._own is None and not os.environ.get(ev.ENV_ADDRESS):
            from .standalone import Standalone

            self._own = Standalone(self.run_name)

    def store_init_configuration(self, values: Any) -> None:
        self.start()
        self.tracker.config(flat_config(values))

    def log(self, values: dict, step: int | None = None, **_kwargs: Any) -> None:
        self.start()  # accelerate calls start() in init_trackers; a log without it still counts
        if step is None:
            step = self._next
        if type(step) is int or hasattr(step, "__index__"):
            self._next = max(self._next, int(step) + 1)
        scalars: dict[str, Any] = {}
        for name, v in _flat(values, "/"):
            if isinstance(v, str):  # accelerate allows text; a note in the record keeps it
                self.tracker.log(f"{name} (step {step}): {v}")
            else:
                scalars[name] = v  # report() counts what is not a number, and says so once
        if scalars:
            self.tracker.report(step, **scalars)

    def checkpoint(self, path: Any, step: int | None = None) -> None:
        """A checkpoint this run saved (listed on the run; what run.resume() continues from)."""
        self.start()
        self.tracker.checkpoint(path, self._next - 1 if step is None and self._next else step)

    def flush(self) -> None:
        """Send what is queued, waiting up to 2 s."""
        if self._own is not None or self.tracker.enabled:
            self.tracker.flush(2.0)

    def finish(self, status: str | None = None) -> None:
        """The end of training: a run of its own ends (`status`, default succeeded, as
        accelerator.end_training() means); in a run gpu_lab started, what is queued is sent."""
        if self._own is not None:
            self._own.close(status)
        else:
            self.tracker.flush(2.0)

    def __repr__(self) -> str:
        return "gpu_lab.Tracker()"


def flat_config(values: Any) -> dict[str, Any]:
    """A config (a dict, an argparse Namespace, a dataclass) as {name: plain value}: nested dicts
    flattened with dots, lists of plain values kept, anything else as its text."""
    if not isinstance(values, dict):
        if hasattr(values, "to_dict"):
            values = values.to_dict()
        elif hasattr(values, "__dict__"):
            values = vars(values)
        else:
            return {"config": str(values)}
    out: dict[str, Any] = {}
    for name, v in _flat(values, "."):
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # the row's JSON has no NaN
        elif isinstance(v, (list, tuple)) and all(isinstance(x, PLAIN) for x in v):
            v = list(v)
        elif not isinstance(v, PLAIN):
            v = str(v)
        out[name] = v
    return out


def _flat(d: dict, sep: str, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _flat(v, sep, key)
        else:
            yield key, v


def _register() -> None:
    try:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, register_tracker_class
    except ImportError:  # accelerate < 1.15: pass Tracker() itself
        return
    if LOGGER_TYPE_TO_CLASS.get(Tracker.name) is not Tracker:
        register_tracker_class(Tracker)


_register()
