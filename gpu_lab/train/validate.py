"""Checks of a whole TrainConfig against the model and the host, before any process starts.

TrainConfig validates each field alone (types, ranges, choices); this module refuses the
combinations that cannot work, so a launch fails in the kernel in milliseconds instead of in N
workers after the imports. It never imports torch and never asks torch.cuda (which would
initialise CUDA in the kernel and poison the fork): GPUs are counted through NVML.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..config import MODEL_NAMES, TrainConfig


class ConfigError(ValueError):
    """A configuration that cannot run; `.field` names the offending TrainConfig field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"TrainConfig.{field}: {message}")
        self.field = field


def as_config(config: TrainConfig | Mapping[str, Any] | None = None, **overrides: Any) -> TrainConfig:
    """A TrainConfig from a TrainConfig, a dict (other tools' key names accepted) or keywords."""
    if config is None:
        return TrainConfig.from_dict(overrides)
    if isinstance(config, TrainConfig):
        return config.replace(**overrides) if overrides else config
    if isinstance(config, Mapping):
        return TrainConfig.from_dict({**config, **overrides})
    raise TypeError(f"config: got {type(config).__name__}; accepted: a TrainConfig or a dict")


def validate(config: TrainConfig | Mapping[str, Any], *, num_processes: int | None = None,
             gpu_count: int | None = None) -> TrainConfig:
    """Return `config` as a TrainConfig, or raise ConfigError naming the field, the value and what
    would work. `gpu_count` defaults to NVML's count (gpu_lab.telemetry.probe)."""
    from ..models import check_input

    cfg = as_config(config)
    if gpu_count is None:
        from ..telemetry.probe import gpu_count as _gpu_count

        gpu_count = _gpu_count()
    nproc = num_processes if num_processes is not None else cfg.num_processes

    if cfg.model not in MODEL_NAMES:  # TrainConfig checks this too; kept for dicts built by hand
        raise ConfigError("model", f"got {cfg.model!r}; accepted: {', '.join(MODEL_NAMES)}")
    try:
        check_input(cfg.model, cfg.num_classes, cfg.image_size)
    except ValueError as e:
        field = "num_classes" if str(e).startswith("num_classes") else "image_size"
        raise ConfigError(field, str(e)) from None

    if cfg.mixed_precision == "fp16" and gpu_count == 0:
        raise ConfigError("mixed_precision", "got 'fp16', but this host has no GPU (NVML sees none). "
                          "fp16 autocast with loss scaling needs CUDA; on a CPU use 'bf16' or 'no'.")
    if cfg.mixed_precision == "bf16" and gpu_count > 0:
        cc = min_compute_capability()
        if cc is not None and cc < (8, 0):
            raise ConfigError("mixed_precision", f"got 'bf16', but this host's GPUs have compute "
                              f"capability {cc[0]}.{cc[1]}; bf16 needs 8.0 or newer (A100, H100, "
                              "RTX 30xx…). Use 'fp16' (with loss scaling) or 'no'.")
    if cfg.decode == "gpu" and gpu_count == 0:
        raise ConfigError("decode", "got 'gpu', but this host has no GPU (NVML sees none): the "
                          "batch decoder (nvJPEG) runs on the training GPU. Use 'cpu' (the "
                          "DataLoader workers decode) or 'auto'.")
    if cfg.decode == "gpu" and cfg.augment == "autoaugment":
        raise ConfigError("decode", "got 'gpu' with augment='autoaugment': AutoAugment and "
                          "RandomErasing run per image in the DataLoader workers. Use "
                          "augment='basic' (crop + flip run on the GPU) or decode='cpu'.")
    if gpu_count > 0 and nproc is not None and nproc > gpu_count:
        raise ConfigError("num_processes", f"got {nproc}, but this host has {gpu_count} GPU(s); "
                          f"accepted: 1..{gpu_count} (one process per GPU)")
    if cfg.data_dir is not None and not Path(cfg.data_dir).expanduser().is_dir():
        raise ConfigError("data_dir", f"got {cfg.data_dir!r}: no such directory. Accepted: an "
                          "ImageFolder or WebDataset shard directory, or empty for synthetic data.")
    if cfg.max_steps is not None and cfg.profile_steps > cfg.max_steps:
        raise ConfigError("profile_steps", f"got {cfg.profile_steps}, more than max_steps="
                          f"{cfg.max_steps}; accepted: 0..{cfg.max_steps}")
    if nproc == 1 and cfg.zero:
        raise ConfigError("zero", "got True with num_processes=1: ZeRO shards optimizer state "
                          "across ranks, and one rank has nothing to shard. Use num_processes >= 2 "
                          "or zero=False.")
    if cfg.sharding == "fsdp":
        _check_fsdp(cfg, gpu_count)
    if nproc == 1 and cfg.powersgd:
        raise ConfigError("powersgd", "got True with num_processes=1: PowerSGD compresses the "
                          "gradient all-reduce between ranks, and one rank has none. Use "
                          "num_processes >= 2 or powersgd=False.")
    if cfg.oom_retry and nproc is not None and nproc > 1:
        raise ConfigError("oom_retry", f"got True with num_processes={nproc}: after an OOM the "
                          "other ranks are stuck inside the gradient all-reduce, so a run cannot "
                          "retry in place. Use oom_retry with one process to find the batch size, "
                          "then launch the multi-process run with it.")
    return cfg


def _check_fsdp(cfg: Any, gpu_count: int) -> None:
    """What fit() cannot combine with sharding='fsdp'."""
    if cfg.mixed_precision == "fp16":
        raise ConfigError("mixed_precision", "got 'fp16' with sharding='fsdp': fp16's loss scaler "
                          "does not handle sharded gradients here. Use 'bf16' (no loss scaling) "
                          "or sharding='zero1'.")
    if cfg.powersgd:
        raise ConfigError("powersgd", "got True with sharding='fsdp': PowerSGD is a DDP "
                          "communication hook, and FSDP reduce-scatters its gradients itself. "
                          "Use one of the two.")
    if cfg.compile:
        raise ConfigError("compile", "got True with sharding='fsdp': fit() compiles through "
                          "accelerate's DDP path. Use one of the two.")
    if cfg.offload and gpu_count == 0:
        raise ConfigError("offload", "got True on a host without a GPU: the parameters live in CPU "
                          "memory already. Use offload=False (sharding='fsdp' still shards them).")


def min_compute_capability() -> tuple[int, int] | None:
    """The lowest CUDA compute capability among this host's GPUs, asked of NVML (not torch.cuda,
    which would initialise CUDA in the kernel); None when NVML cannot tell."""
    from ..telemetry.probe import nvml_session

    with nvml_session() as (nv, _):
        try:
            caps = [tuple(nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(i)))
                    for i in range(nv.nvmlDeviceGetCount())] if nv is not None else None
        except Exception:  # noqa: BLE001 - no driver, no NVML: unknown, not an error
            caps = None
    if caps is None:
        return None
    return min(caps) if caps else None


__all__ = ["ConfigError", "validate", "as_config", "min_compute_capability"]
