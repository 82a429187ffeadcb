"""Out of memory in the fit loop: the error with what to try, and the halve-the-batch retry.

An OOM leaves the step half done: activations and gradients of the failed micro-batch are still
referenced from the exception's traceback. The loop leaves the `except` block first (dropping the
traceback), then calls `free_memory`, then either raises TrainingOutOfMemoryError with a triage or,
with `oom_retry`, continues from the last step boundary with half the per-device batch and twice
the accumulation, so the global batch — and the training math — stay the same.
"""
from __future__ import annotations

import gc

# the message and the smaller batch are pure advice, kept with the run's triage
from ..failures.oom import fit_report as triage, smaller_batch


class TrainingOutOfMemoryError(RuntimeError):
    """Out of memory during training; the message holds the batch sizes and what to try, in order."""


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA) or the allocator's out-of-memory RuntimeError (CPU, MPS, …)."""
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(exc, torch.OutOfMemoryError) or should_reduce_batch_size(exc)


def free_memory() -> None:
    """Collect garbage and return cached blocks to the device (after the traceback is dropped)."""
    from accelerate.utils.memory import clear_device_cache

    gc.collect()
    clear_device_cache(garbage_collection=True)


__all__ = ["TrainingOutOfMemoryError", "is_oom", "free_memory", "smaller_batch", "triage"]
