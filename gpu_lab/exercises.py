"""The tutorials' exercises: each notebook from 02 on ends with a small task and a cell that
checks the learner's answer.

    ANSWER = ...                                  # the learner replaces the ... with an answer
    gpu_lab.exercises.check("02-shards", ANSWER)  # prints: not done yet / done / not yet: why

Every expected answer is computed here, from the same functions the notebooks use (a shard
count, a dtype's epsilon, a schedule's step), never typed. A check never raises for a wrong
answer: it says why, and what to look at again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Exercise:
    notebook: str
    task: str                     # what the learner is asked, as the notebook states it
    expected: Callable[[], Any]   # the right answer, computed
    hint: str                     # what to look at again when the answer is wrong
    close: float = 0.0            # relative tolerance for a number (0: exact)


def _shards() -> int:
    return math.ceil(10_000 / 250)


def _more_precise() -> str:
    import torch

    kept = [d for d in ("float16", "bfloat16")
            if (torch.tensor(1.0, dtype=getattr(torch, d)) + 1e-3).item() != 1.0]
    return kept[0]


def _global_batch() -> int:
    from .config import TrainConfig

    cfg = TrainConfig(batch_size=32, grad_accum_steps=2, num_processes=4)
    return cfg.batch_size * cfg.grad_accum_steps * cfg.num_processes


def _adamw_bytes() -> int:
    from .models import build, num_parameters

    return 2 * 4 * num_parameters(build("resnet18", num_classes=1000, image_size=224))


def _accumulation() -> int:
    return 256 // 64


def _first_peak_step() -> int:
    from .train.schedules import Schedule

    s = Schedule(kind="cosine", total_steps=2000, warmup=100)  # the multiplier of the peak lr
    return next(step for step in range(2000) if s(step) >= 1.0)


def _lost_steps() -> int:
    every, preempted = 200, 450
    return preempted - (preempted // every) * every


def _world() -> int:
    from .export.job import JobSpec

    return JobSpec("gpu_lab.train:train_classifier", num_nodes=4, nproc_per_node=8).world_size


def _ema_updates() -> int:
    decay = 0.999
    return math.ceil(math.log(1 / math.e) / math.log(decay))


def _pruned_share() -> float:
    c_in, c_out, k = 64, 128, 3
    before = c_in * c_out * k * k
    after = (c_in // 2) * (c_out // 2) * k * k
    return after / before


def _data_wait_share() -> float:
    step_ms, waiting_ms = 120, 45  # a profiled step, and the loader's __next__ inside it
    return waiting_ms / step_ms


EXERCISES = {
    "02-shards": Exercise(
        "02_data_pipeline", "How many shards does write_shards make of 10,000 images with "
        "maxcount=250?", _shards, "a shard holds at most maxcount samples; count up"),
    "03-precision": Exercise(
        "03_mixed_precision", "Which of 'float16' and 'bfloat16' keeps 1 + 0.001 apart from 1?",
        _more_precise, "compare 0.001 with each format's eps (the table at the top)"),
    "04-global-batch": Exercise(
        "04_distributed_training", "The global batch of 4 ranks, a per-rank batch of 32 and 2 "
        "accumulation steps?", _global_batch,
        "every rank adds its batch, every accumulation step adds another"),
    "05-adamw": Exercise(
        "05_memory_optimization", "Bytes of AdamW state for ResNet-18 (1,000 classes: "
        "gpu_lab.models.num_parameters tells its size) in fp32, without ZeRO?", _adamw_bytes,
        "AdamW keeps two fp32 moments per parameter, 4 bytes each", close=0.01),
    "07-warmup": Exercise(
        "07_tuning", "A cosine schedule over 2,000 steps with 100 warmup steps: the first step "
        "at the peak learning rate?", _first_peak_step,
        "print Schedule('cosine', 2000, 100)(step) around the end of the warmup "
        "(gpu_lab.train.schedules)"),
    "08-accumulate": Exercise(
        "08_troubleshooting", "A batch of 256 does not fit, 64 does: how many accumulation steps "
        "keep the global batch at 256?", _accumulation,
        "micro-batch × accumulation steps = the batch you wanted"),
    "09-lost-steps": Exercise(
        "09_cost_control", "checkpoint_every=200 and no notice: the machine goes at step 450. "
        "How many steps are trained twice?", _lost_steps,
        "the resume starts at the newest periodic checkpoint"),
    "10-world": Exercise(
        "10_scale_out", "torchrun --nnodes=4 --nproc-per-node=8: how many ranks (WORLD_SIZE)?",
        _world, "one process per GPU, on every node (JobSpec.world_size)"),
    "11-ema": Exercise(
        "11_diffusion_finetune", "EMA with decay 0.999: after how many updates is the starting "
        "weights' share below 1/e?", _ema_updates,
        "the share after n updates is decay**n", close=0.01),
    "12-pruning": Exercise(
        "12_case_studies", "Halving a 3×3 conv's input and output channels (64→32, 128→64) "
        "leaves what share of its weights?", _pruned_share,
        "a conv's weights are c_in × c_out × k × k", close=0.01),
    "06-data-wait": Exercise(
        "06_monitoring_profiling", "In a trace, a 120 ms step spends 45 ms in the data loader's "
        "__next__: what share of the step does the GPU wait for data (0 to 1)?",
        _data_wait_share, "the loader's span divided by the step's span", close=0.01),
}


def verdict(name: str, answer: Any) -> tuple[str, str]:
    """("not done yet" | "done" | "not yet", the sentence) for `answer` to exercise `name`."""
    ex = EXERCISES[name]
    if answer is ... or answer is None:
        return "not done yet", f"not done yet: {ex.task} Set ANSWER and run this cell again."
    want = ex.expected()
    if isinstance(want, str):
        ok = str(answer).strip().lower().removeprefix("torch.") == want
    else:
        try:
            got = float(answer)
        except (TypeError, ValueError):
            return "not yet", f"not yet: {answer!r} is not a number; {ex.hint}."
        ok = math.isclose(got, want, rel_tol=ex.close) if ex.close else got == want
    if ok:
        return "done", f"done: {want} is right."
    return "not yet", f"not yet: {answer!r} is not it; {ex.hint}."


def check(name: str, answer: Any) -> None:
    """Print the verdict on `answer` to exercise `name` (a notebook's exercise cell)."""
    print(verdict(name, answer)[1])
