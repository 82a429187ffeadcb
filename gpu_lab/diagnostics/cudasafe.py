"""Run CPU-only torch code in a process that must stay able to fork CUDA workers (the kernel).

`torch.cuda.is_available()` calls cudaGetDeviceCount unless NVML answers first, and that poisons
every later fork of the process even when no GPU exists and `torch.cuda.is_initialized()` stays
False: forked workers then start in CUDA's bad-fork state. torch asks it in places one would not
expect — FakeTensorMode on every operation, `Adam(W).step()` (a CUDA-graph capture check),
`torch.utils.checkpoint` (its default device). Inside `cuda_probe_off()`, is_available() answers
False without asking CUDA, so such code runs on the CPU and leaves the process fork-safe.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_lock = threading.Lock()


@contextlib.contextmanager
def cuda_probe_off() -> Iterator[None]:
    """Within the block, torch.cuda.is_available() is False and never touches the driver. Only
    for code that must run on the CPU anyway (dry runs, FLOP counting)."""
    import torch
    from torch.utils import checkpoint

    with _lock:
        orig = torch.cuda.is_available
        cached = checkpoint.DefaultDeviceType._default_device_type
        torch.cuda.is_available = lambda: False
        try:
            yield
        finally:
            torch.cuda.is_available = orig
            # checkpoint caches the device type it inferred: leave no "cpu" behind for later code
            checkpoint.DefaultDeviceType._default_device_type = cached


__all__ = ["cuda_probe_off"]
