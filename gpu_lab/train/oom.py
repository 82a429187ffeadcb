"""Out of memory in the fit loop: the error with what to try, and the halve-the-batch retry.

An OOM leaves the step half done: activations and gradients of the failed micro-batch are still
referenced from the exception's traceback. The loop leaves the `except` block first (dropping the
traceback), then calls `free_memory`, then either raises TrainingOutOfMemoryError with a triage or,
with `oom_retry`, continues from the last step boundary with half the per-device batch and twice
the accumulation, so the global batch — and the training math — stay the same.
"""
from __future__ import annotations

import gc


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


def smaller_batch(micro_batch: int, accum: int) -> tuple[int, int] | None:
    """(micro_batch', accum') with micro_batch' < micro_batch and the same product, or None.

    Halves when it can; an odd batch goes to its largest proper divisor (9 → 3, 7 → 1)."""
    if micro_batch <= 1:
        return None
    for d in range(micro_batch // 2, 0, -1):
        if micro_batch % d == 0:
            return d, accum * (micro_batch // d)
    return None  # pragma: no cover - d = 1 always divides


def suggestions(config, micro_batch: int, accum: int, num_processes: int) -> list[str]:
    """What to try, cheapest for the result first (gpu_lab.failures.explain's advice)."""
    from ..failures.explain import oom_suggestions

    return oom_suggestions(batch_size=micro_batch, grad_accum_steps=accum,
                           num_processes=num_processes, mixed_precision=config.mixed_precision,
                           activation_checkpointing=config.activation_checkpointing,
                           zero=config.zero, oom_retry=config.oom_retry, model=config.model,
                           image_size=config.image_size)


def triage(config, *, step: int, micro_batch: int, accum: int, num_processes: int,
           error: BaseException | str) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"out of memory at step {step + 1} with a per-device batch of {micro_batch} "
             f"(× {accum} accumulation × {num_processes} process(es) = global batch "
             f"{micro_batch * accum * num_processes}), model {config.model}, image_size "
             f"{config.image_size}, mixed_precision={config.mixed_precision!r}.",
             f"  error: {first}",
             "  try, in this order:"]
    lines += [f"  {i}. {s}" for i, s in enumerate(suggestions(config, micro_batch, accum, num_processes), 1)]
    return "\n".join(lines)


__all__ = ["TrainingOutOfMemoryError", "is_oom", "free_memory", "smaller_batch", "suggestions", "triage"]
