"""DataLoader worker processes: what they do with stop signals, and how they are ended.

Every loader gpu_lab builds (shard loaders, and fit's loaders over datasets) uses these, so a
Stop, a Slurm preemption or a Ctrl-C reaches the training process, which checkpoints at the step
boundary, and never kills the workers under it first.
"""
from __future__ import annotations

import os
import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: a SIGTERM / SIGUSR1 / SIGINT sent to the whole process group is
    for the training process to handle (checkpoint, then exit 143); if the workers died of it first,
    the loop would fail on "DataLoader worker killed" before reaching the step boundary. Workers
    still exit when their parent does (PyTorch's worker watchdog), and `end_workers` kills any
    that do not stop when asked."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)



def end_workers(iterator: Any) -> int:
    """Stop the worker processes of a DataLoader iterator now; returns how many had to be killed.

    PyTorch asks the workers to finish, waits, then sends SIGTERM to those still there, which
    workers that ignore stop signals survive: a worker stuck in a read that never returns would
    then outlive its loader, and the training process would wait for it forever when it exits.
    Those get SIGKILL here."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:  # no worker processes (num_workers=0)
        return 0
    shutdown()
    stuck = [w for w in getattr(iterator, "_workers", ()) if w.is_alive()]
    for w in stuck:
        w.kill()
        w.join(5.0)
    return len(stuck)


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


def kill_live_workers() -> None:
    """SIGKILL this process's DataLoader workers that are still alive (it is about to exit)."""
    import multiprocessing as mp

    for p in mp.active_children():
        if getattr(getattr(p, "_target", None), "__name__", "") == "_worker_loop":
            p.kill()
            p.join(5.0)


__all__ = ["ignore_stop_signals", "end_workers", "kill_workers_at_exit", "kill_live_workers",
           "STOP_SIGNALS"]
