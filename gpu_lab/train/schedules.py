"""Learning-rate schedules as pure functions of the optimizer step (nanoGPT's `get_lr` style).

Every schedule is `multiplier(step) -> float` applied to the peak lr, with a linear warmup over the
first `warmup_ratio` of the steps (the default: the first 5%, then cosine). Being pure functions
of the step, resuming a run restores the schedule by restoring the step counter alone; the
LambdaLR wrapper exists so that the optimizer's lr and checkpoints look like any PyTorch run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Scheduler


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(round(total_steps * warmup_ratio))


def warmup_factor(step: int, warmup: int) -> float:
    """Linear from 1/warmup at step 0 to 1 at step warmup-1 (never 0: step 0 must move the weights)."""
    if warmup <= 0 or step >= warmup:
        return 1.0
    return (step + 1) / warmup


def cosine(step: int, total_steps: int, warmup: int, min_ratio: float = 0.0) -> float:
    """Warmup, then half a cosine from 1 down to `min_ratio` at the last step."""
    if step < warmup:
        return warmup_factor(step, warmup)
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant(step: int, warmup: int) -> float:
    return warmup_factor(step, warmup)


def step_decay(step: int, warmup: int, step_size: int, gamma: float) -> float:
    """Warmup, then multiply by `gamma` every `step_size` steps (counted from the end of warmup)."""
    if step < warmup:
        return warmup_factor(step, warmup)
    return gamma ** ((step - warmup) // step_size)


@dataclass
class Schedule:
    """A picklable multiplier(step) built from a TrainConfig (LambdaLR saves its fields, which are
    plain numbers, so a checkpoint of it loads with weights_only=True)."""

    kind: str
    total_steps: int
    warmup: int
    step_size: int = 1000
    gamma: float = 0.1
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if self.kind == Scheduler.COSINE:
            return cosine(step, self.total_steps, self.warmup, self.min_ratio)
        if self.kind == Scheduler.CONSTANT:
            return constant(step, self.warmup)
        if self.kind == Scheduler.STEP:
            return step_decay(step, self.warmup, self.step_size, self.gamma)
        raise ValueError(f"scheduler: got {self.kind!r}; accepted: {', '.join(Scheduler.choices())}")

    @classmethod
    def from_config(cls, config, total_steps: int) -> "Schedule":
        return cls(kind=str(config.scheduler), total_steps=int(total_steps),
                   warmup=warmup_steps(total_steps, config.warmup_ratio),
                   step_size=int(config.step_size), gamma=float(config.gamma))


def build_scheduler(optimizer, config, total_steps: int):
    """A LambdaLR driven by `Schedule`; step it once per optimizer step."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, Schedule.from_config(config, total_steps))


__all__ = ["Schedule", "build_scheduler", "cosine", "constant", "step_decay", "warmup_factor",
           "warmup_steps"]
