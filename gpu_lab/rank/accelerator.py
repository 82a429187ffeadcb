"""What a training function uses inside a worker: the right Accelerator and control requests.

Training code imports this (through `gpu_lab.accelerator`); it never imports widgets.
"""
from __future__ import annotations

import atexit
import functools
import os
from pathlib import Path
from typing import Any

from ..record import events as ev
from ..record.runfolder import RunFolder


def device_kind() -> str:
    """'cuda' when this launch uses GPUs, 'cpu' otherwise (decided by the launcher via NVML,
    without initialising CUDA in the kernel)."""
    kind = os.environ.get(ev.ENV_DEVICE)
    if kind:
        return kind
    from ..telemetry.probe import gpu_count

    return "cuda" if gpu_count() > 0 else "cpu"


def accelerator(**kwargs: Any):
    """An `accelerate.Accelerator` that forms a real process group on every host.

    On a host without a GPU, a plain `Accelerator()` in N forked workers trains N independent
    copies (DistributedType.NO). Here `cpu=True` is passed there, so the workers form a gloo group
    (DistributedType.MULTI_CPU) with the world size the launch asked for.
    """
    from accelerate import Accelerator

    if device_kind() == "cpu":
        kwargs.setdefault("cpu", True)
    acc = Accelerator(**kwargs)
    _register_exit_hook()
    return acc


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(_destroy_process_group_at_exit)


def _destroy_process_group_at_exit() -> None:
    """At interpreter exit, before finalization starts: destroy the default process group and let
    gloo's worker threads finish with the Python objects they still hold.

    A gloo thread destroys a finished collective's work after the caller's wait() returned; the
    tensors in it have Python objects, so it takes the GIL. Once Python is finalizing, a thread
    that takes the GIL is ended with pthread_exit, whose unwinding through the work's noexcept
    destructor aborts the process ("terminate called without an active exception", SIGABRT): a
    torchrun rank that finished, or that fit() ended with Preempted (143), exits -6 (3 of 10 runs
    of the preemption test here; a core dump shows ProcessGroupGloo::runLoop → ~AsyncBroadcastWork
    → decref → take_gil → PyThread_exit_thread). atexit handlers run before finalization, so
    giving up the GIL here for a moment lets that thread finish first."""
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway: a failed clean-up must not replace the exit code
        pass
    time.sleep(0.05)  # releases the GIL; a pending work destructor needs microseconds of it


def control_dir() -> Path | None:
    """Where this rank's run takes requests (None outside a launched run)."""
    folder = RunFolder.from_env()
    return folder.control_dir if folder is not None else None


def control_requested(name: str, consume: bool = False) -> bool:
    """True when the kernel asked for `name` ("checkpoint", "stop") through Run.request_*().

    It is a stat() call: cheap, but call it at a step boundary, not per sample. Ranks should agree
    on the answer through a broadcast from rank 0 (the training loop does).
    """
    folder = RunFolder.from_env()
    return folder is not None and folder.control_requested(name, consume)
