"""Optimizers: AdamW or SGD, optionally sharded across ranks (ZeRO stage 1).

Weight decay applies to weight matrices and convolution kernels only; biases and normalisation
parameters (1-D tensors) are not decayed (the nanoGPT / timm convention — decaying a LayerNorm gain
toward zero only hurts).
"""
from __future__ import annotations

from ..config import Optimizer


def param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model, config, *, zero: bool = False):
    """The optimizer TrainConfig asks for. With `zero`, a ZeroRedundancyOptimizer that keeps on each
    rank only its shard of the optimizer state (ZeRO stage 1; Adam's two moments are 2× the fp32
    weights, so with N ranks each saves ≈ (N-1)/N of that) — needs a process group."""
    import torch

    kind = str(config.optimizer)
    if kind == Optimizer.ADAMW:
        cls, kw = torch.optim.AdamW, {"lr": config.lr}
    elif kind == Optimizer.SGD:
        cls, kw = torch.optim.SGD, {"lr": config.lr, "momentum": config.momentum}
    else:
        raise ValueError(f"optimizer: got {kind!r}; accepted: {', '.join(Optimizer.choices())}")
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(param_groups(model, config.weight_decay), optimizer_class=cls,
                                       **kw)
    return cls(param_groups(model, config.weight_decay), **kw)


__all__ = ["build_optimizer", "param_groups"]
