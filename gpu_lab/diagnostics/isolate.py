"""Run a function in a forked child and bring back its result, so that what it does to torch's
process state stays out of the calling process (the notebook kernel).

Why: a backward pass on fake or meta tensors starts autograd's device threads, and from then on
every child forked from the process fails its own backward ("Unable to handle autograd's
threading in combination with fork-based multiprocessing") — the kernel could no longer launch
training. A dry run therefore runs in a throwaway fork: the child inherits the imported modules
(no start-up cost), does the work, sends the result back through a pipe and exits.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import traceback
from typing import Any, Callable


class ChildError(RuntimeError):
    """The child died or sent an exception that could not be rebuilt here."""


def in_child(fn: Callable, *args: Any, timeout: float = 600, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a forked child; its return value, or its exception re-raised here."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller's stack
        code = 0
        try:
            os.close(r)
            # inherited sys.stdout may be a kernel's zmq stream: the child stays silent
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            sys.stdout = sys.stderr = open(os.devnull, "w")
            if "torch" in sys.modules:
                # GNU OpenMP's thread pool does not survive a fork: if the parent ran a parallel
                # region on several threads, the child's first one hangs. One thread is enough here.
                sys.modules["torch"].set_num_threads(1)
            try:
                payload = pickle.dumps(("ok", fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                try:
                    payload = pickle.dumps(("error", exc, text))
                except Exception:  # noqa: BLE001 - an unpicklable exception: send its text
                    payload = pickle.dumps(("error", None, text))
            with os.fdopen(w, "wb") as f:
                f.write(payload)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish within {timeout} s")
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if ready:
                data = os.read(r, 1 << 20)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks)
    if not raw:
        raise ChildError(f"{getattr(fn, '__name__', fn)} died in its child process "
                         f"(exit status {os.waitstatus_to_exitcode(status)}) without a result; "
                         "out of host memory?")
    msg = pickle.loads(raw)  # written by our own child
    if msg[0] == "ok":
        return msg[1]
    if msg[1] is not None:
        raise msg[1]
    raise ChildError(msg[2])


__all__ = ["in_child", "ChildError"]
