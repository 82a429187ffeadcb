"""Helpers for checking real process trees (no sleeps as synchronisation: poll with a deadline)."""
from __future__ import annotations

import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def processes(pids) -> list[psutil.Process]:
    """The processes with these pids that still exist (pids from another process, e.g. a kernel)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition",
               hint=None):
    """pred()'s first true value, polled; past `timeout`, an AssertionError naming `what` (and
    hint(), what there was to see instead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                         + (f": {hint()}" if hint is not None else ""))


def run_or_dump(cmd: list[str], env: dict, timeout: float) -> "subprocess.CompletedProcess":  # noqa: F821 - imported inside
    """subprocess.run(cmd) with output captured; past `timeout`, every process of its tree is asked
    for its Python stacks (SIGUSR2: the command registers faulthandler for it, and its ranks and
    DataLoader workers inherit that), then killed, and the test fails with the stacks: a hang in
    CI says where it was, and leaves no process behind."""
    import signal
    import subprocess

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        procs = tree(p.pid)
        for q in procs:
            try:
                q.send_signal(signal.SIGUSR2)
            except psutil.Error:
                pass
        try:  # the dumps arrive on the inherited stderr; the processes go on hanging
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for q in alive(procs):
            q.kill()
        out, err = p.communicate()  # EOF once the whole tree, which holds the pipes, is gone
        raise AssertionError(f"{' '.join(cmd[1:3])}: no result after {timeout:g} s; the stacks of "
                             f"its {len(procs)} processes:\n{err[-20000:]}\n{out[-3000:]}") from None
