"""GPU (NVML) and host (psutil) telemetry, sampled by one shared thread per process.

Nothing happens at import: NVML initialises on the first sample and the thread starts with the
first subscriber. Never uses torch.cuda (that would initialise CUDA in the kernel; see nvml.py).
"""
from .host import HOST_FIELDS, HostSampler
from .nvml import GPU_FIELDS, GPU_ID_FIELDS, Device, NVMLSampler, resolve_visible, throttle_names
from .sampler import MIN_INTERVAL, Sampler, get_sampler

__all__ = ["get_sampler", "Sampler", "NVMLSampler", "HostSampler", "GPU_FIELDS", "GPU_ID_FIELDS",
           "HOST_FIELDS", "Device", "resolve_visible", "throttle_names", "MIN_INTERVAL"]
