"""fit()'s FSDP: parameters, gradients and optimizer state split across the ranks (FSDP2).

`TrainConfig(sharding="fsdp")` shards each block the model is made of (the residual and
transformer blocks gpu_lab.train.activation knows, else each child that holds parameters), then
the model, with torch's `fully_shard`: the API accelerate's FSDP2 plugin calls. fit() calls it
itself because accelerate shards only on GPUs: on a CPU host accelerate turns an FSDP-configured
model into DDP without a word, while fully_shard over a gloo group really shards, so a CPU host
measures what a GPU host will (each of N ranks holds about 1/N of the parameters and of the
optimizer state). Mixed precision stays accelerate's autocast, as under DDP.

A checkpoint holds the full model and optimizer state, gathered to rank 0 (torch's
distributed-checkpoint state-dict API, a collective), in the same files as an unsharded run's;
resuming scatters them back, so a checkpoint is read whatever the sharding that wrote it, and a
resumed run may even have another number of ranks.
"""
from __future__ import annotations

from typing import Any


def shard(model: Any, offload: bool = False) -> Any:
    """`model` with every block, then the whole, sharded over the default process group (in
    place; returns it). `offload`: parameters live in CPU memory between uses (GPU runs)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from .activation import block_types

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    blocks = [m for m in model.modules() if m is not model and isinstance(m, block_types())]
    if not blocks:  # a model of plain layers: each child that holds parameters
        blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    for block in blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    _keep_checked(model, blocks)
    return model


def _keep_checked(model: Any, blocks: list) -> None:
    """Where a CPU rank checks devices (gpu_lab.rank.devicecheck), the parameters FSDP gathers
    before each block computes are on the device, as on a GPU: no mode sees FSDP place them."""
    from ..rank import devicecheck

    if not devicecheck.active():
        return
    devicecheck.mark(model.parameters())  # the shards, which the optimizer holds
    for m in (*blocks, model):  # after FSDP's own pre-forward hook, which gathers them
        m.register_forward_pre_hook(lambda mod, args: devicecheck.mark(mod.parameters()))


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_bytes(tensors: Any) -> int:
    """Bytes of `tensors` (parameters, or optimizer-state tensors) this rank holds: a sharded
    tensor's local shard, a plain tensor whole."""
    import torch

    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer: Any) -> int:
    """This rank's optimizer-state bytes (AdamW's two moments, SGD's momentum; not step counts)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer's local optimizer
    return local_bytes(t for s in inner.state.values() for t in s.values()
                       if getattr(t, "dim", lambda: 0)() > 0)


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model: Any, optimizer: Any) -> tuple[dict, dict]:
    """Collective: (model state, optimizer state), whole, on rank 0 (other ranks: empty), in CPU
    memory; the optimizer's keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = _options(cpu_offload=True)
    inner = getattr(optimizer, "optimizer", optimizer)
    return (get_model_state_dict(model, options=opts),
            get_optimizer_state_dict(model, inner, options=opts))


def load_full_state(model: Any, optimizer: Any, model_state: dict, optimizer_state: dict) -> None:
    """Collective: every rank takes its shards of a whole model and optimizer state."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    inner = getattr(optimizer, "optimizer", optimizer)
    set_model_state_dict(model, model_state, options=_options())
    set_optimizer_state_dict(model, inner, optimizer_state, options=_options())


__all__ = ["shard", "is_sharded", "local_bytes", "optimizer_bytes", "full_state",
           "load_full_state"]
