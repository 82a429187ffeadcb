"""What a training checkpoint holds, and how every rank saves and restores it.

A resumed run must continue exactly where the saved one stood: model weights (safetensors),
optimizer, scheduler, fp16 loss scaler, every rank's RNG states, the step counter and the position
in the data (epoch and micro-batches consumed in it). Rank 0 is the only writer — one writer makes
the atomic directory protocol of checkpoint.py sufficient — and the other ranks hand it their RNG
states through one all_gather_object. Saving and loading are collective: every rank calls them.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from . import checkpoint as ck

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"


# --- RNG states as tensors and plain data (so torch.load(weights_only=True) accepts them) ---------
def rng_state(device=None) -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch CPU, and the CUDA generator of `device`
    (only this rank's GPU: asking for every GPU's state would create a CUDA context on each)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device=None) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device is not None and torch.device(device).type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# --- the pieces of a run ---------------------------------------------------------------------------
def _inner_optimizer(optimizer):
    """The torch optimizer under accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(_inner_optimizer(optimizer), ZeroRedundancyOptimizer)


def _sharded(model) -> bool:
    from .sharding import is_sharded

    return is_sharded(model)


def _gathered(model, optimizer) -> tuple[dict, dict] | None:
    """An FSDP model's whole state and its optimizer's, on rank 0; None for another model."""
    if not _sharded(model):
        return None
    from .sharding import full_state

    return full_state(model, optimizer)


def save_training_state(accelerator, model, optimizer, scheduler, *, root: str | Path, step: int,
                        trainer_state: dict[str, Any], keep_last: int | None = None) -> Path:
    """Collective: every rank calls it; rank 0 writes `root/step_N` atomically. Returns the path on
    every rank, or raises the writer's error on every rank (so none waits for a dead writer)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file, save_model

    multi = accelerator.num_processes > 1
    rngs = [rng_state(accelerator.device)]
    if multi:
        rngs = [None] * accelerator.num_processes
        dist.all_gather_object(rngs, rng_state(accelerator.device))
    opt = _inner_optimizer(optimizer)
    if _is_zero(optimizer):
        opt.consolidate_state_dict(to=0)  # ZeRO: the shards travel to rank 0 (collective)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    whole = _gathered(unwrapped, optimizer)  # FSDP: the shards, gathered on rank 0 (collective)

    result: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            opt_state = whole[1] if whole else opt.state_dict()
            parts: dict[str, Any] = {OPTIMIZER_FILE: opt_state, RNG_FILE: rngs}
            if scheduler is not None:
                parts[SCHEDULER_FILE] = scheduler.state_dict()
            scaler = getattr(accelerator, "scaler", None)
            if scaler is not None:  # fp16 loss scaling: the scale and its growth tracker
                parts[SCALER_FILE] = scaler.state_dict()
            files = {MODEL_FILE: (lambda p: save_file(whole[0], str(p))) if whole else
                     (lambda p: save_model(unwrapped, str(p))),
                     STATE_FILE: lambda p: ck.write_json(p, trainer_state)}
            files.update({name: (lambda p, obj=obj: torch.save(obj, p)) for name, obj in parts.items()})
            need = (state_bytes(whole[0] if whole else unwrapped.state_dict(), per_tensor=256)
                    + sum(state_bytes(obj) + 2048 for obj in parts.values())  # + a zip's framing
                    + len(json.dumps(trainer_state, default=str)) + 1024)
            meta = {"step": int(step), "reason": trainer_state.get("reason", ""),
                    "num_processes": accelerator.num_processes}
            result[0] = str(ck.save_checkpoint(root, step, files, meta=meta, keep_last=keep_last,
                                               needed_bytes=need))
        except Exception as e:  # noqa: BLE001 - handed to every rank below, then raised
            result[0] = e
    if multi:
        if not isinstance(result[0], (str, type(None))):
            result[0] = f"!{type(result[0]).__name__}: {result[0]}"
        dist.broadcast_object_list(result, src=0)
    out = result[0]
    if isinstance(out, Exception):
        raise out
    if isinstance(out, str) and out.startswith("!"):
        raise ck.CheckpointError(f"rank 0 failed to save the checkpoint of step {step}: {out[1:]}")
    return Path(out)


def state_bytes(obj: Any, per_tensor: int = 1024) -> int:
    """About the bytes `obj` (nested dicts, lists, tuples of tensors and plain data) takes in a
    file: each tensor's bytes plus `per_tensor` of framing (torch.save: a zip entry and its pickle
    record; safetensors: a header entry), and a generous allowance for plain values. Errs high."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() + per_tensor
    if isinstance(obj, dict):
        return 16 + sum(len(str(k)) + 16 + state_bytes(v, per_tensor) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 16 + sum(state_bytes(v, per_tensor) for v in obj)
    return 8 + (len(obj) if isinstance(obj, (str, bytes)) else 16)


def load_training_state(accelerator, model, optimizer, scheduler, info: ck.CheckpointInfo) -> dict:
    """Restore a checkpoint on every rank (each rank reads the files). Returns the trainer state;
    RNG states are returned under "rng" for the caller to apply right before the next step."""
    from safetensors.torch import load_model

    path, manifest = info.path, info.manifest or ck.read_manifest(info.path)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    opt = _inner_optimizer(optimizer)
    try:
        if _sharded(unwrapped):  # every rank reads the whole state and keeps its shards
            from safetensors.torch import load_file

            from .sharding import load_full_state

            load_full_state(unwrapped, opt,
                            load_file(ck.checkpoint_file(path, MODEL_FILE, manifest)),
                            ck.load_object(path, OPTIMIZER_FILE, manifest))
        else:
            load_model(unwrapped, ck.checkpoint_file(path, MODEL_FILE, manifest), strict=True)
            opt.load_state_dict(ck.load_object(path, OPTIMIZER_FILE, manifest))
    except (RuntimeError, KeyError) as e:
        raise ck.CheckpointError(f"{path}: {MODEL_FILE} does not fit this model (was it saved from "
                                 f"another model or num_classes?): {str(e).splitlines()[0]}") from None
    if scheduler is not None and SCHEDULER_FILE in manifest["files"]:
        scheduler.load_state_dict(ck.load_object(path, SCHEDULER_FILE, manifest))
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and SCALER_FILE in manifest["files"]:
        scaler.load_state_dict(ck.load_object(path, SCALER_FILE, manifest))
    state = ck.load_json(path, STATE_FILE, manifest)
    rngs = ck.load_object(path, RNG_FILE, manifest)
    state["rng"] = rngs[accelerator.process_index % len(rngs)]
    return state


__all__ = ["save_training_state", "load_training_state", "rng_state", "set_rng_state",
           "state_bytes"]
