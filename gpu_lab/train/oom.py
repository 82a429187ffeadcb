"""Out-of-memory triage and the halve-the-batch retry (seed 000 §4.1: "reduce batch_size, enable
gradient checkpointing, free unused variables").

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
    """What to try, cheapest for the result first."""
    out = []
    smaller = smaller_batch(micro_batch, accum)
    if smaller:
        b, a = smaller
        out.append(f"batch_size={b}, grad_accum_steps={a}: the same global batch of "
                   f"{micro_batch * accum * num_processes}, so the same training math, in smaller "
                   f"pieces" + ("" if config.oom_retry else " (oom_retry=True does this for you)"))
    if config.mixed_precision == "no":
        out.append("mixed_precision='bf16' (or 'fp16' on GPUs without bf16): activations take half "
                   "the memory (seed 000 §2.2: −40%)")
    if not config.activation_checkpointing:
        out.append("activation_checkpointing=True: recompute activations in backward (≈40% less "
                   "activation memory for ≈25% more compute)")
    if not config.zero and num_processes > 1 and config.optimizer == "adamw":
        out.append("zero=True: shard AdamW's two moment buffers across the ranks")
    out.append(f"a smaller image_size (now {config.image_size}) or a smaller model (now {config.model})")
    out.append("watch memory while it runs (GPUPanel, or `nvidia-smi -l 1`) to tell a leak from a "
               "peak")
    return out


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
