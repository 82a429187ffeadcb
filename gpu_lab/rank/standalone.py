"""A run that gpu_lab did not start, recorded from inside: `accelerate launch train.py`, torchrun
or `python train.py` with `Accelerator(log_with=gpu_lab.Tracker())`.

The tracker lives on the main process (accelerate's rule), so rank 0 records the run: it makes
(or, after a torchrun restart, revives) the run's row as a headless rank would
(gpu_lab.rank.headless: kind torchrun / slurm / python, the launcher's pid, so that a run whose
launcher died reads as lost), starts a Recorder of its own, and points gpu_lab.report at it.
The run ends when the tracker finishes (`accelerator.end_training()`): succeeded; or at the
interpreter's exit: failed if an exception ended the script, else succeeded.
"""
from __future__ import annotations

import atexit
import sys
import threading
import traceback
from typing import Any


class Standalone:
    """This process's own record of the run (rank 0's); `close()` ends it, once."""

    def __init__(self, name: str | None = None) -> None:
        from ..record.registry import Registry
        from ..record.runfolder import RunFolder
        from .rows import derive_run_id, detect_topology, open_row, start_recording

        self.topo = detect_topology()
        self.run_id = derive_run_id(self.topo)
        self.registry = Registry()
        folder = RunFolder.of(self.run_id).create(fresh=False)
        open_row(self.registry, self.run_id, self.topo, None, folder.path,
                 name or (sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "run"))
        self.recorder, self.reporter = start_recording(self.registry, self.run_id, folder)
        self.error: str | None = None
        self._closed = threading.Lock()
        self._hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.close)

    def _excepthook(self, kind: type, value: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            self.error = "".join(traceback.format_exception(kind, value, tb))[-4000:]
        self._hook(kind, value, tb)

    def close(self, status: str | None = None) -> None:
        from .rows import close_row

        if not self._closed.acquire(blocking=False):
            return
        self.reporter.close(2.5)
        self.recorder.close()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._hook
        status = status or ("failed" if self.error else "succeeded")
        close_row(self.registry, self.run_id, self.topo, status, self.error)
