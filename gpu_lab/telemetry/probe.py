"""NVML sessions, and how many GPUs this host has: asked of NVML, never of torch.cuda (which
would initialise CUDA in the calling process and poison every later fork)."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator


def open_nvml(nvml: Any = None) -> tuple[Any, str | None]:
    """(the initialised NVML module, None), or (None, why not). `nvml`: pynvml by default, or a
    stand-in with its interface (gpu_lab.telemetry.doubles.FakeNVML)."""
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        return nvml, None
    except ImportError as e:
        return None, f"nvidia-ml-py is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
        return None, f"NVML unavailable: {e}"


def close_nvml(nvml: Any) -> None:
    """Shut an open_nvml() session down; an error there is of no use to anyone."""
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass


@contextlib.contextmanager
def nvml_session(nvml: Any = None) -> Iterator[tuple[Any, str | None]]:
    """`with nvml_session() as (nv, why):` nv is the initialised NVML module for the block (shut
    down after it), or None where there is no usable NVML, and `why` says why."""
    nv, why = open_nvml(nvml)
    try:
        yield nv, why
    finally:
        if nv is not None:
            close_nvml(nv)


@functools.lru_cache(maxsize=1)
def _nvml_count() -> int:
    with nvml_session() as (nv, _):
        try:
            return int(nv.nvmlDeviceGetCount()) if nv is not None else 0
        except Exception:  # noqa: BLE001 - a driver that answers nothing: no GPU to use
            return 0


def gpu_count() -> int:
    """GPUs visible to this process: NVML's count, narrowed by CUDA_VISIBLE_DEVICES."""
    n = _nvml_count()
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return n
    vis = vis.strip()
    if vis in ("", "-1", "none", "NoDevFiles"):
        return 0
    return min(n, len([v for v in vis.split(",") if v.strip()]))


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 itself (AVX512-BF16 or AMX), as oneDNN says. Elsewhere torch
    emulates it: bf16 autocast on such a CPU ran a convolution 37x slower than fp32 (AVX2 only)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN: no fast bf16 either
        return False
