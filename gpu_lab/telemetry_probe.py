"""How many GPUs this host has, asked of NVML, never of torch.cuda (which would initialise CUDA
in the calling process and poison every later fork)."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def _nvml_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
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
