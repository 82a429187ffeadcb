"""How a rank ends, the same for a notebook launch (RankEntry) and a headless one (torchrun, srun):
its exit code, the signals that stop it, and the result and error files it leaves in the run
folder (gpu_lab.record.runfolder).

Contract:
- STOP_EXIT_CODE (143, 128 + SIGTERM) is the one exit code of a rank, a supervisor or a job that
  stopped on request or by a scheduler: schedulers read it as "stopped, resumable" (the exported
  Slurm script requeues on it).
- STOP_SIGNALS are the signals that ask a run to stop: SIGTERM (Run.stop, stop_run, torchrun's
  shutdown, a scheduler), SIGUSR1 (Slurm's warning before the time limit), SIGHUP (a closed
  terminal, or the elastic agent passing one on). A rank checkpoints at the next step boundary and
  exits STOP_EXIT_CODE; loader workers ignore them, and INTERRUPT_SIGNAL too (Ctrl-C reaches the
  whole process group; it is the training process's KeyboardInterrupt, exit 130, not a stop).
- rank 0's return value lands in result.pkl. One that cannot be pickled is not a failed run: an
  Unpicklable (the reason) is stored instead, the rank says so in its log, and Run.result()
  raises with that reason, on both launch paths.
- a failed rank's exception lands in errors/rank<r>.json (a triaged RankFailure), atomically.

Importing this is cheap and never imports torch (gpu_lab.export.slurm reads the exit code here).
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
from dataclasses import dataclass
from typing import Any

from ..failures.kinds import STOP_EXIT_CODE  # 128 + SIGTERM: its home is the failure model's

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2          # headless: bad arguments, nothing started
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a KeyboardInterrupt

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
INTERRUPT_SIGNAL = signal.SIGINT


@dataclass
class Unpicklable:
    """What result.pkl holds when rank 0's return value could not be pickled."""

    reason: str


def write_result(folder: Any, value: Any, reporter: Any = None) -> Unpicklable | None:
    """Store rank 0's return value in the run folder. Where it cannot be pickled, store an
    Unpicklable and say so in the rank's log and, through `reporter`, in the run's record."""
    try:
        payload = pickle.dumps(value)
        failed = None
    except Exception as exc:  # noqa: BLE001 - any pickling error: the run itself succeeded
        failed = Unpicklable(f"{type(value).__name__}: {exc}")
        payload = pickle.dumps(failed)
        text = (f"rank 0's return value could not be pickled ({failed.reason}); Run.result() "
                "will raise: return something picklable (numbers, dicts, CPU tensors, a path)")
        print(f"gpu_lab: {text}", file=sys.stderr, flush=True)
        if reporter is not None:
            reporter.log(text)
    try:
        folder.write_result(payload)
    except OSError as exc:  # a full disk: the run did its work; its return value is not kept
        text = (f"rank 0's return value could not be written to {folder.result_file} "
                f"({exc.strerror}); Run.result() will raise. The training itself succeeded")
        print(f"gpu_lab: {text}", file=sys.stderr, flush=True)
        if reporter is not None:
            reporter.log(text)
    return failed


def read_result(folder: Any) -> Any:
    """Rank 0's return value from result.pkl (None without one); an Unpicklable where it could
    not be stored."""
    payload = folder.read_result()
    return None if payload is None else pickle.loads(payload)  # written by the run's own rank 0


def write_error(folder: Any, rank: int, exc: BaseException) -> Any:
    """Triage a rank's exception and store it as errors/rank<r>.json; returns the RankFailure."""
    from ..failures import triage

    failure = triage.from_exception(rank, exc)
    failure.pid = os.getpid()
    _keep_error(folder, rank, failure)
    return failure


def _keep_error(folder: Any, rank: int, failure: Any) -> None:
    """The rank's error file; on a full disk the record's error event is what is left."""
    try:
        folder.write_error(rank, failure.to_dict())
    except OSError as exc:
        print(f"gpu_lab: rank {rank}'s error could not be written to {folder.error_file(rank)} "
              f"({exc.strerror})", file=sys.stderr, flush=True)


def write_exit(folder: Any, rank: int, exc: SystemExit) -> Any:
    """A rank that called sys.exit(code != 0): the failure names the code and what the code
    printed last (its log's end), as a terminal would have shown it; returns the RankFailure."""
    from ..failures import triage

    said = str(exc.code) if exc.code is not None and not isinstance(exc.code, int) else None
    sys.stdout.flush()
    sys.stderr.flush()
    failure = triage.from_exit(rank, exit_code(exc), said, _tail(folder.log_file(rank)))
    failure.pid = os.getpid()
    _keep_error(folder, rank, failure)
    return failure


def _tail(path: Any, size: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def exit_code(exc: SystemExit) -> int:
    """The process exit code a SystemExit stands for (sys.exit("text") exits 1)."""
    if exc.code is None:
        return EXIT_OK
    return exc.code if isinstance(exc.code, int) else EXIT_FAILED


class Stopped(SystemExit):
    """A stop signal arrived outside the training toolkit's guard; exits with 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(STOP_EXIT_CODE)
        self.signum = signum

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} outside fit()'s preemption guard "
                f"(exit code {STOP_EXIT_CODE}); no checkpoint was written by gpu_lab")


def raise_stopped(signum: int, frame: Any) -> None:
    """A handler for STOP_SIGNALS outside fit(): end the rank as 'stopped' with exit code 143
    (so that a scheduler requeues it) rather than as a silent death (SIGUSR1's default action kills
    the process: a warning that arrives while the ranks still import torch would lose the job).
    fit() installs its own PreemptionGuard while it runs (checkpoint first) and restores this
    handler afterwards."""
    raise Stopped(signum)


def set_stop_handlers(handler: Any) -> None:
    """Install `handler` for every stop signal (signal.SIG_IGN: a second signal must not cut the
    bookkeeping of an ending short; it takes seconds, and SIGKILL still works)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def kill_live_workers() -> None:
    """SIGKILL this process's daemonic children that are still alive (it is about to exit).

    DataLoader workers are daemonic: multiprocessing would end them with SIGTERM at exit, which
    these ignore. (A started Process no longer knows its target, so daemonic is the mark.)"""
    import multiprocessing as mp
    import threading

    if threading.current_thread() is threading.main_thread():
        # PyTorch's SIGCHLD handler raises "DataLoader worker killed" for its workers' deaths,
        # which would cut this loop short after the first one
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    workers = [p for p in mp.active_children() if p.daemon]
    for p in workers:
        p.kill()
    for p in workers:
        p.join(5.0)
