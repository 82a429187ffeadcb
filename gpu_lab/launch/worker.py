"""What a training function uses inside a worker: the right Accelerator and control requests.

Training code imports this (through `gpu_lab.accelerator`); it never imports widgets.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..stream import events as ev


def device_kind() -> str:
    """'cuda' when this launch uses GPUs, 'cpu' otherwise (decided by the launcher via NVML,
    without initialising CUDA in the kernel)."""
    kind = os.environ.get(ev.ENV_DEVICE)
    if kind:
        return kind
    from ..telemetry_probe import gpu_count

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
    return Accelerator(**kwargs)


def control_dir() -> Path | None:
    d = os.environ.get(ev.ENV_RUN_DIR)
    return Path(d) / "control" if d else None


def control_requested(name: str, consume: bool = False) -> bool:
    """True when the kernel asked for `name` ("checkpoint", "stop") through Run.request_*().

    It is a stat() call: cheap, but call it at a step boundary, not per sample. Ranks should agree
    on the answer through a broadcast from rank 0 (the training loop does).
    """
    d = control_dir()
    if d is None:
        return False
    p = d / name
    if p.exists():
        if consume:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        return True
    return False
