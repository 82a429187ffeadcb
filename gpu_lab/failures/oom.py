"""What to try after an out-of-memory error, cheapest first, with whatever numbers are known: the
one place this advice is written. The run's triage (explain), the fit loop's error
(gpu_lab.train.oom) and oom_report use it; smaller_batch is also the fit loop's oom_retry step.
Pure: numbers in, text out."""
from __future__ import annotations

from ..hardware import classes_with_memory
from ..units import fmt_bytes


def smaller_batch(micro_batch: int, accum: int) -> tuple[int, int] | None:
    """(micro_batch', accum') with micro_batch' < micro_batch and the same product, or None.

    Halves when it can; an odd batch goes to its largest proper divisor (9 → 3, 7 → 1)."""
    if micro_batch <= 1:
        return None
    for d in range(micro_batch // 2, 0, -1):
        if micro_batch % d == 0:
            return d, accum * (micro_batch // d)
    return None  # pragma: no cover - d = 1 always divides


def _gpus_with(need: float) -> str:
    """A few GPU classes that hold `need` bytes, smallest first, for the advice's example."""
    return ", ".join(classes_with_memory(need)[:4])


def oom_suggestions(requested: int | None = None, free: int | None = None,
                    total: int | None = None, batch_size: int | None = None, *,
                    device: str = "GPU 0", reserved_unallocated: int | None = None,
                    grad_accum_steps: int = 1, num_processes: int = 1,
                    mixed_precision: str | None = None,
                    activation_checkpointing: bool | None = None, zero: bool | None = None,
                    memory_cap: bool = False, oom_retry: bool | None = None,
                    model: str | None = None, image_size: int | None = None) -> list[str]:
    """What to try after an out-of-memory error, cheapest first, with whatever numbers are known
    (none: the advice that holds for every OOM)."""
    out = []
    short = requested - free if requested is not None and free is not None else None
    if (reserved_unallocated and device.startswith("GPU") and requested is not None
            and reserved_unallocated >= min(requested, short if short and short > 0 else requested)):
        out.append(f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no code change): "
                   f"{fmt_bytes(reserved_unallocated)} is cached by PyTorch but fragmented, "
                   f"enough for the {fmt_bytes(requested)} that did not fit")
    smaller = smaller_batch(batch_size, grad_accum_steps) if batch_size else None
    if smaller:
        b, a = smaller
        glob = batch_size * grad_accum_steps * num_processes
        out.append(f"batch_size={b} (from {batch_size}) with grad_accum_steps={a}: the same global "
                   f"batch of {glob}, so the same training math; activation memory, which grows "
                   f"with the batch, {'roughly halves' if 2 * b == batch_size else 'shrinks'}"
                   + (" (oom_retry=True does this for you)" if oom_retry is False else ""))
    else:
        out.append("a smaller batch_size, with grad_accum_steps raised to keep the global batch")
    if mixed_precision in (None, "no"):
        out.append("mixed_precision='bf16' (or 'fp16' on GPUs without bf16): activations take "
                   "half the bytes, and it is faster")
    if not activation_checkpointing:
        out.append("activation_checkpointing=True: keep only block inputs and recompute the rest "
                   "in backward (≈40% less activation memory for ≈25% more compute)")
    if num_processes > 1 and not zero:
        out.append(f"zero=True: shard the optimizer state over the {num_processes} ranks")
    if requested is not None and total is not None and free is not None:
        need = total - free + requested
        where = "memory cap" if memory_cap else "device"
        gpus = _gpus_with(need * 1.1)
        out.append(f"a {where} with more than {fmt_bytes(need)} (in use at the failure plus the "
                   f"request)" + (f": e.g. {gpus}" if gpus and not memory_cap else ""))
    if model is not None and image_size is not None:
        out.append(f"a smaller image_size (now {image_size}) or a smaller model (now {model})")
    out.append("watch memory while it runs (GPUPanel, or `nvidia-smi -l 1`): memory that grows "
               "step after step is a leak (a tensor kept across steps, e.g. an un-detached loss), "
               "not a peak")
    return out


def oom_report(requested: int | None, free: int | None, total: int | None,
               batch_size: int | None = None, *, device: str = "GPU 0",
               allocated: int | None = None, reserved_unallocated: int | None = None,
               memory_cap: bool = False, **facts) -> str:
    """The out-of-memory triage as text: the numbers, then what to try, cheapest first.

    `facts`: grad_accum_steps, num_processes, mixed_precision, activation_checkpointing, zero.
    """
    head = oom_sentence(requested, free, total, batch_size, device, allocated,
                        reserved_unallocated, memory_cap)
    tips = oom_suggestions(requested, free, total, batch_size, device=device,
                           reserved_unallocated=reserved_unallocated, memory_cap=memory_cap,
                           **facts)
    return "\n".join([head, "What to try, cheapest first:"]
                     + [f"  {i}. {s}" for i, s in enumerate(tips, 1)])


def oom_sentence(requested, free, total, batch_size, device, allocated=None,
                 reserved_unallocated=None, memory_cap=False) -> str:
    """The out-of-memory failure in one sentence, with the numbers that are known."""
    where = f"{device} (a memory cap of {fmt_bytes(total)})" if memory_cap else device
    # oneDNN's failures do not say how much they asked for
    parts = [f"Out of memory on {where}: " + (f"tried to allocate {fmt_bytes(requested)}"
                                              if requested is not None else "an allocation failed")]
    if free is not None and total is not None:
        parts.append(f" with {fmt_bytes(free)} free of {fmt_bytes(total)}")
    if batch_size:
        parts.append(f", batch size {batch_size}")
    parts.append(".")
    if requested is not None and free is not None and requested > free:
        parts.append(f" The request is {fmt_bytes(requested - free)} more than what was free.")
    if allocated is not None:
        parts.append(f" PyTorch held {fmt_bytes(allocated)} in tensors"
                     + (f" and {fmt_bytes(reserved_unallocated)} cached but unused"
                        if reserved_unallocated is not None else "") + ".")
    return "".join(parts)


def fit_suggestions(config, micro_batch: int, accum: int, num_processes: int) -> list[str]:
    """What to try after an OOM in the fit loop, cheapest for the result first; `config` is the
    run's TrainConfig (read, never imported: the failures import nothing above them)."""
    return oom_suggestions(batch_size=micro_batch, grad_accum_steps=accum,
                           num_processes=num_processes, mixed_precision=config.mixed_precision,
                           activation_checkpointing=config.activation_checkpointing,
                           zero=config.zero, oom_retry=config.oom_retry, model=config.model,
                           image_size=config.image_size)


def fit_report(config, *, step: int, micro_batch: int, accum: int, num_processes: int,
               error: BaseException | str) -> str:
    """The fit loop's out-of-memory message: where it failed, with which batch, then what to
    try (parse_oom reads the batch back from it: "per-device batch of N")."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"out of memory at step {step + 1} with a per-device batch of {micro_batch} "
             f"(× {accum} accumulation × {num_processes} process(es) = global batch "
             f"{micro_batch * accum * num_processes}), model {config.model}, image_size "
             f"{config.image_size}, mixed_precision={config.mixed_precision!r}.",
             f"  error: {first}",
             "  try, in this order:"]
    tips = fit_suggestions(config, micro_batch, accum, num_processes)
    lines += [f"  {i}. {s}" for i, s in enumerate(tips, 1)]
    return "\n".join(lines)


__all__ = ["smaller_batch", "oom_suggestions", "oom_report", "oom_sentence", "fit_suggestions",
           "fit_report"]
