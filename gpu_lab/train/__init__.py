"""gpu_lab.train: the fit loop and its parts — precision, accumulation, activation checkpointing,
schedules, atomic checkpoints, guards (preemption, memory threshold, OOM, NaN), callbacks.

    from gpu_lab.train import fit, train_classifier, validate
    summary = fit(model, dataset, TrainConfig(max_steps=100, mixed_precision="bf16"))

Never imports widgets. Imported lazily, like gpu_lab itself: `validate` (what the kernel calls
before a launch) does not import torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_API = {
    "fit": ".loop",
    "make_accelerator": ".loop",
    "train_classifier": ".classifier",
    "validate": ".validate",
    "ConfigError": ".validate",
    "Callback": ".callbacks",
    "TrainState": ".callbacks",
    "PreemptionGuard": ".guards",
    "MemoryGuard": ".guards",
    "NonFiniteLossGuard": ".guards",
    "ControlRequests": ".guards",
    "Preempted": ".guards",
    "NonFiniteLossError": ".guards",
    "PREEMPT_EXIT_CODE": ".guards",
    "ProfilerWindow": ".profiling",
    "TrainingOutOfMemoryError": ".oom",
    "CheckpointError": ".checkpoint",
    "CheckpointStorageError": ".checkpoint",
    "latest_checkpoint": ".checkpoint",
    "list_checkpoints": ".checkpoint",
    "Schedule": ".schedules",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    mod = _API.get(name)
    if mod is None:
        raise AttributeError(f"module 'gpu_lab.train' has no attribute {name!r}")
    value = getattr(import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
