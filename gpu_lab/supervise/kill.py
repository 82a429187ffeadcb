"""Ending a run's process tree from outside it: Run.stop() and stop_run() ask here.

terminate_tree records the stop request in the run folder (the ranks checkpoint at the next step,
the supervisor reports "stopped" with the reason), then signals the tree: SIGTERM first, SIGKILL
for what is left after the grace period. It never waits with waitpid(): the supervisor may be the
caller's child, whose exit status belongs to the thread that reaps it.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from ..record.runfolder import RunFolder


def terminate_tree(pid: int, run_dir: Path | None, grace: float = 5.0,
                   pid_started: float | None = None, reason: str = "stopped",
                   status: str = "stopped") -> None:
    """End a supervisor's whole process tree: graceful (SIGTERM), then forceful (SIGKILL).

    The tree is snapshotted first, because once the supervisor dies its workers are re-parented
    and can no longer be found through it; the process group catches anything started later.
    """
    import psutil

    if run_dir is not None:
        RunFolder(run_dir).request_stop(reason, status)  # status: what the end is recorded as
    try:
        sup = psutil.Process(pid)
        if pid_started is not None and abs(sup.create_time() - pid_started) > 1.0:
            return  # the pid was reused by an unrelated process
        procs = [sup] + sup.children(recursive=True)
    except psutil.Error:
        return
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    if pgid is not None and pgid == os.getpgid(0):
        pgid = None  # never signal our own group (the supervisor failed to set its own)
    _signal_all(procs, pgid, signal.SIGTERM)
    # Poll rather than psutil.wait_procs: that would waitpid() the supervisor, which is our child,
    # and steal its exit status from the thread that waits for it.
    _wait_gone(procs, grace)
    # Ranks that ignored SIGTERM go first; the supervisor then has a moment to record the end
    # (a supervisor killed before that leaves a run that readers call lost).
    ranks = [p for p in procs[1:] if _alive(p) and not _is_recorder(p)]
    if ranks:
        _signal_all(ranks, None, signal.SIGKILL)
        _wait_gone(ranks, 5.0)
        _wait_gone(procs[:1], 5.0)
    leftover = [p for p in procs if _alive(p)]
    if leftover:
        _signal_all(leftover, pgid, signal.SIGKILL)
        _wait_gone(leftover, 5.0)


def _is_recorder(p) -> bool:
    """The run's recorder: it writes the end the supervisor hands it, and exits by itself."""
    try:
        return "gpu_lab.record.recorder" in p.cmdline()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def _wait_gone(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.05)


def _alive(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: list, pgid: int | None, sig: int) -> None:
    import psutil

    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
