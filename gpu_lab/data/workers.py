"""DataLoader worker processes: what they do with stop signals, and how they are ended.

Every loader gpu_lab builds (shard loaders, and fit's loaders over datasets) uses these, so a
Stop, a Slurm preemption or a Ctrl-C reaches the training process, which checkpoints at the step
boundary, and never kills the workers under it first.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.context import (BaseContext, ForkContext, ForkProcess, ForkServerContext,
                                     ForkServerProcess, SpawnContext, SpawnProcess)
from typing import Any

from ..rank.outcome import INTERRUPT_SIGNAL, STOP_SIGNALS, kill_live_workers

# the stop signals and Ctrl-C, which reaches the whole process group too: all are the training
# process's to handle
IGNORED_SIGNALS = (*STOP_SIGNALS, INTERRUPT_SIGNAL)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: a stop signal or a SIGINT sent to the whole process group is
    for the training process to handle (checkpoint, then exit 143); if the workers died of it first,
    the loop would fail on "DataLoader worker killed" before reaching the step boundary. Workers
    still exit when their parent does (PyTorch's worker watchdog), and `end_workers` kills any
    that do not stop when asked."""
    for s in IGNORED_SIGNALS:
        signal.signal(s, signal.SIG_IGN)  # discards one that arrived while blocked (below)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED_SIGNALS)


class _StopSafe:
    def start(self) -> None:
        kill_workers_at_exit()  # registered in the process that starts them, which will wait
        # Started with the stop signals blocked: until ignore_stop_signals runs in the worker, a
        # stop sent to the process group would otherwise find PyTorch's worker SIGTERM handler,
        # which dies of it (a Stop at the start of an epoch failed the run). The starting
        # process gets its own signal as soon as it unblocks.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


# module level: spawn pickles the Process object, so its class must be importable
class _ForkProcess(_StopSafe, ForkProcess):
    pass


class _SpawnProcess(_StopSafe, SpawnProcess):
    pass


class _ForkServerProcess(_StopSafe, ForkServerProcess):
    pass


class _ForkContext(ForkContext):
    Process = _ForkProcess


class _SpawnContext(SpawnContext):
    Process = _SpawnProcess


class _ForkServerContext(ForkServerContext):
    Process = _ForkServerProcess


_CONTEXTS = {"fork": _ForkContext(), "spawn": _SpawnContext(), "forkserver": _ForkServerContext()}


def worker_options(method: str | BaseContext | None = None) -> dict[str, Any]:
    """DataLoader keyword arguments for workers that leave stop signals to the training process:
    `worker_init_fn` and `multiprocessing_context` (`method`'s, default this platform's)."""
    ctx = method if isinstance(method, BaseContext) else mp.get_context(method)
    return {"worker_init_fn": ignore_stop_signals,
            "multiprocessing_context": _CONTEXTS.get(ctx.get_start_method(), ctx)}


# multiprocessing's Unix sockets for passing tensors between workers and the training process:
# <tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX, within Linux's 107 bytes for a socket's path
SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def check_socket_room(tempdir: str | None = None) -> None:
    """DataLoader workers cannot start where the temporary folder's path is too long for their
    sockets: a clear error before they are made (otherwise a worker fails with "AF_UNIX path too
    long" and the loader can hang waiting for it)."""
    import tempfile

    folder = tempdir if tempdir is not None else tempfile.gettempdir()
    if len(folder.encode()) + _SOCKET_SUFFIX > SOCKET_PATH_MAX:
        raise ValueError(
            f"DataLoader workers need sockets under the temporary folder, whose path must stay "
            f"within {SOCKET_PATH_MAX - _SOCKET_SUFFIX} characters; this one ({folder}) has "
            f"{len(folder.encode())}. Set TMPDIR to a shorter folder (such as /tmp), or use "
            f"num_workers=0.")


def end_workers(iterator: Any) -> None:
    """Stop the worker processes of a DataLoader iterator now.

    PyTorch asks the workers to finish, waits, then sends SIGTERM to those still there, which
    workers that ignore stop signals survive: a worker stuck in a read that never returns would
    then outlive its loader, and the training process would wait for it forever when it exits.
    Those get SIGKILL here."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:  # no worker processes (num_workers=0)
        return
    shutdown()
    for w in getattr(iterator, "_workers", ()):
        if w.is_alive():
            w.kill()
            w.join(5.0)


_hooked_pid: int | None = None


def kill_workers_at_exit() -> None:
    """When this process exits, SIGKILL the DataLoader workers it still has (once per process).

    multiprocessing ends a process by sending SIGTERM to its daemonic children, then waiting for
    them; workers that ignore SIGTERM would keep it waiting forever (a preempted rank that never
    exits, because an iterator was still alive). This runs first, from multiprocessing's own exit
    function, which also ends processes that multiprocessing started (the ranks)."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return
    _hooked_pid = os.getpid()
    from multiprocessing import util

    util.Finalize(None, kill_live_workers, exitpriority=100)  # before the children are joined


__all__ = ["ignore_stop_signals", "worker_options", "end_workers", "kill_workers_at_exit",
           "kill_live_workers", "IGNORED_SIGNALS"]
