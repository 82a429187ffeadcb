"""The function each rank of a notebook launch runs (RankEntry), forked by the supervisor.

It points the rank's output at its log in the run folder, resets reporting, checks fork safety,
calls the user's function and records how the rank ended (gpu_lab.rank.outcome): rank 0's return
value, or any rank's exception, or a stop (the loop checkpointed and exited 143). Elastic would
pickle a return value through a queue: it is kept on disk instead.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable

from ..access import open_private, private_dir
from ..record import events as ev
from ..record.runfolder import RunFolder
from ..record.storage import LogStream, lost_bytes
from . import adopt, outcome


class RankEntry:
    """The function each rank runs: set up output and reporting, check fork safety, call the
    user's function, keep its return value (rank 0) or its exception (any rank)."""

    def __init__(self, fn: Callable, run_dir: str, tempdir: str | None = None) -> None:
        self.fn = fn
        self.folder = RunFolder(run_dir)
        self.tempdir = tempdir  # the temp dir the user's code gets (the supervisor's elastic/)
        self.supervisor_pid = os.getpid()
        self.__name__ = getattr(fn, "__name__", "train")  # elastic names the job after it
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    @property
    def run_dir(self):
        return self.folder.path

    def __call__(self, *args: Any) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if os.getpid() != self.supervisor_pid:  # one rank runs in the supervisor itself
            _die_with_parent(self.supervisor_pid)
        tempfile.tempdir = self.tempdir
        redirect_output(self.folder.log_file(rank))
        from ..record import reporter as rep

        rep.reset_reporter()
        reporter = rep.get_reporter()
        self.folder.write_pid(rank, os.getpid())
        previous = _catch_stops()
        try:
            result = self._run(rank, reporter, previous, args)
            if rank == 0:
                outcome.write_result(self.folder, result, reporter)
            _say_lost_output(self.folder, rank, reporter)
            reporter.close(2.0)
        finally:
            try:  # what it sent: a recorder that replaced a dead one counts what never arrived
                self.folder.write_sent(rank, reporter.sent)
            except OSError:
                pass
            for sig, handler in (previous or {}).items():  # one rank runs in the supervisor
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        return None  # elastic would pickle a return value through a queue: keep it on disk

    def _run(self, rank: int, reporter: Any, previous: dict | None, args: tuple) -> Any:
        """The user's function, and how it ended; stop signals are ignored from its end on, so
        that a second one (the launcher's, after the user's) cannot cut the bookkeeping short."""
        try:
            _check_fork_safe()
            adopt.prepare()  # accelerate's group and tracker, no nested ranks, not interactive
            reporter.running()
            result = self.fn(*args)
            _quiet(previous)
            return result
        except SystemExit as exc:
            _quiet(previous)
            code = outcome.exit_code(exc)
            if code == outcome.STOP_EXIT_CODE:  # the loop checkpointed, or a stop came
                self.folder.mark_preempted(rank)  # outside it (then say so: a script saves
                if isinstance(exc, outcome.Stopped) and rank == 0:  # what it saves itself)
                    reporter.log(str(exc))
                reporter.status("preempted")
                reporter.close(1.0)
                raise
            if code != outcome.EXIT_OK:
                failure = outcome.write_exit(self.folder, rank, exc)
                reporter.error(failure.to_dict())
                reporter.close(1.0)
                raise
            return None  # sys.exit(0) and sys.exit(): a script's way to succeed
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised for the launcher
            _quiet(previous)
            self._record_failure(rank, exc, reporter)
            raise

    def _record_failure(self, rank: int, exc: BaseException, reporter: Any) -> None:
        failure = outcome.write_error(self.folder, rank, exc)
        traceback.print_exc()
        reporter.error(failure.to_dict())
        reporter.close(1.0)


def _say_lost_output(folder: RunFolder, rank: int, reporter: Any) -> None:
    lost = lost_bytes()
    if lost:
        reporter.log(f"rank {rank}: {lost} bytes of its output could not be written to "
                     f"{folder.log_file(rank)} (its disk refused them: full, over quota or "
                     "read-only)")


def _catch_stops() -> dict | None:
    """Outside fit()'s guard a stop ends the rank as stopped (143), through the user's finally
    blocks (an `except Exception` in their code does not catch it). Returns the handlers it
    replaced (None off the main thread, where signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {s: signal.getsignal(s) for s in outcome.STOP_SIGNALS}
    outcome.set_stop_handlers(outcome.raise_stopped)
    return previous


def _quiet(previous: dict | None) -> None:
    if previous is not None:
        outcome.set_stop_handlers(signal.SIG_IGN)


def _check_fork_safe() -> None:
    import torch

    if torch._C._cuda_isInBadFork() and os.environ.get(ev.ENV_DEVICE) == "cuda":
        raise RuntimeError(
            "CUDA was initialised in the process this worker was forked from (bad-fork "
            "state). Restart the kernel and keep CUDA calls inside the training function.")


def redirect_output(path: os.PathLike) -> None:
    """Point fd 1/2 and sys.stdout/sys.stderr at a file (line-buffered). In a process forked from a
    kernel, the inherited sys.stdout writes into the kernel's zmq sockets: never use it."""
    private_dir(os.path.dirname(os.fspath(path)))
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout, sys.stderr = LogStream(1), LogStream(2)
    LogStream.reset()  # the process it was forked from counted its own
    sys.stdin = open(0, "r", closefd=False)



def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGTERM this rank when its supervisor dies (killed, say): the rank then
    checkpoints and exits like a preempted one instead of training on, unwatched, forever."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the rank outlives a killed supervisor
        return
    if os.getppid() != parent:  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)
