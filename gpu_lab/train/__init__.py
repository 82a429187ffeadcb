"""gpu_lab.train: the fit loop and its parts — precision, accumulation, activation checkpointing,
schedules, atomic checkpoints, guards (preemption, memory threshold, OOM, NaN), callbacks.

    from gpu_lab.train import fit, train_classifier, validate
    summary = fit(model, dataset, TrainConfig(max_steps=100, mixed_precision="bf16"))

Never imports widgets. Imported lazily, like gpu_lab itself: `validate` (what the kernel calls
before a launch) does not import torch.
"""
from __future__ import annotations

from gpu_lab._lazy import lazy_api


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
    "best_checkpoint": ".inference",
    "load_model": ".inference",
    "predict": ".inference",
    "Schedule": ".schedules",
    "ResumeMismatchError": ".resume",
}

__getattr__, __dir__, __all__ = lazy_api(__name__, _API)
