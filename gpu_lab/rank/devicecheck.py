"""Tensors follow the model: a CPU rank that refuses what a GPU would refuse.

On a GPU, `model(torch.randn(256, 4))` after `acc.prepare(model)` fails ("Expected all tensors to
be on the same device"): the input stayed on the CPU, the model went to `acc.device`. On a host
without a GPU both live on the CPU, nothing fails, and the mistake waits for the GPU server. With
GPU_LAB_STRICT_DEVICE=1 in a rank's environment (`launch(..., env={"GPU_LAB_STRICT_DEVICE":
"1"})`; the tutorials' tests set it for every rank), a CPU rank treats its device as a device of
its own, as CUDA would:

- on the device: what `.to(device)` moves (a model's parameters and buffers through
  `model.to(...)` or `acc.prepare`, a prepared loader's batches), what is made with `device=`,
  a marked parameter's `.grad`, and every result of an operation that read such a tensor;
- off it: everything else, and what `.cpu()` returns;
- an operation that mixes the two raises DeviceMismatch, naming the operation and both tensors.
  As on CUDA, a 0-dimensional CPU tensor may meet a device tensor, indexing may use CPU indices,
  and `copy_` / `__setitem__` may copy across.

A check of the code, not of the numbers: the training computes as it would without it, more
slowly (every torch call passes through Python). On a GPU, CUDA makes the check itself and this is
not installed.
"""
from __future__ import annotations

import os
from typing import Any

VARIABLE = "GPU_LAB_STRICT_DEVICE"
_MARK = "_gpu_lab_on_device"
# what CUDA lets cross devices: indexing with CPU indices, copies, swapping a parameter's data,
# and the checks torch makes before such a swap
CROSSING = frozenset({"__getitem__", "__setitem__", "copy_", "index_put_", "index_put", "__set__",
                      "set_", "_has_compatible_shallow_copy_type", "is_same_size", "is_set_to",
                      "__deepcopy__", "__reduce_ex__", "__repr__", "__format__",
                      # FSDP2's own copies in and out of its communication buffers, which it
                      # makes on its device: a library's inner work, right on a GPU
                      "all_gather_copy_in", "split_with_sizes_copy", "chunk_cat"})


class DeviceMismatch(RuntimeError):
    """An operation mixed a tensor on the rank's device with one left on the CPU."""


def wanted() -> bool:
    return os.environ.get(VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def device() -> Any:
    """The device object that stands for the rank's device (accelerate's `acc.device` does too):
    `torch.zeros(3, device=devicecheck.device())` is made there."""
    global _DEVICE
    if _DEVICE is None:
        import torch

        _DEVICE = torch.device("cpu")
    return _DEVICE


def on_device(t: Any) -> bool:
    """Whether the check counts `t` as living on the rank's device."""
    return bool(getattr(t, _MARK, False))


def _mark(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        try:
            setattr(out, _MARK, True)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            pass
    elif isinstance(out, (list, tuple)):
        for o in out:
            _mark(o)
    return out


def _unmark(t: Any) -> None:
    if on_device(t):
        delattr(t, _MARK)


def active() -> bool:
    """Whether this process checks devices (GPU_LAB_STRICT_DEVICE in a CPU rank)."""
    return bool(_ACTIVE)


def mark(tensors: Any) -> None:
    """Count these tensors as living on the device: for a library that places tensors on the
    device in ways no mode sees (FSDP2 gathers a block's parameters into its own buffers)."""
    for t in tensors:
        _mark(t)


def _off(out: Any) -> Any:
    """`out` off the device: on a CPU, .cpu() of a CPU tensor is the tensor itself, so a device
    tensor leaves it as a new view of the same memory (autograd follows a view; a sparse tensor,
    which has no views, as a copy)."""
    import torch

    if not on_device(out):
        return out
    return out.view_as(out) if out.layout == torch.strided else out.clone()


def _tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among the arguments, one level into lists and tuples (torch.cat, _foreach_*)."""
    import torch

    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _describe(t: Any) -> str:
    return f"{'device' if on_device(t) else 'CPU'} tensor of shape {tuple(t.shape)}"


def _accelerate_device() -> Any:
    """The device object accelerate's shared state holds (what `acc.device` returns), if any."""
    import sys

    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    return shared.get("device")


def _names_the_device(d: Any) -> bool:
    """Whether `d`, a device argument, names the rank's device: a GPU by name or index, or one
    of the device objects that stand for it here (accelerate's, or a device tensor's .device).
    On a CPU `x.device` of a CPU tensor equals the rank's device: only identity tells them apart."""
    import torch

    if d is None:
        return False
    if d is _DEVICE or d is _accelerate_device():
        return True
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return not d.startswith(("cpu", "meta"))
    if isinstance(d, torch.device):
        return d.type not in ("cpu", "meta")
    return False


def _target(func: Any, args: tuple, kwargs: dict) -> bool | None:
    """Where a .to(...) call sends its tensor: True the device, False off it, None where it names
    only a dtype or a memory format (the tensor stays where it is)."""
    import torch

    if "device" in kwargs and kwargs["device"] is not None:
        return _names_the_device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):  # t.to(other): other's device
            return on_device(a)
        if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
            return _names_the_device(a)
    return None


def mode() -> Any:
    """The TorchFunctionMode that keeps the books (enter it in the rank's main thread)."""
    import torch
    from torch.overrides import TorchFunctionMode

    device()
    T = torch.Tensor
    leaving = {T.cpu, T.numpy, T.tolist, T.item}

    class StrictDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in leaving:
                return _off(func(*args, **kwargs))
            name = getattr(func, "__name__", "")
            ins = _tensors(args, kwargs)
            marked = [t for t in ins if on_device(t)]
            if func is T.to:
                target = _target(func, args, kwargs)
                out = func(*args, **kwargs)
                if target is False:
                    return _off(out)
                return _mark(out) if target or (target is None and marked) else out
            if func is T.cuda:
                return _mark(func(*args, **kwargs))
            if name in ("_parse_to", "device") and not ins:  # Module.to(d), torch.device(d)
                out = func(*args, **kwargs)
                said = [*args, kwargs.get("device")]
                if any(a is not None and (a is _DEVICE or a is _accelerate_device())
                       for a in said):
                    return (_DEVICE, *out[1:]) if isinstance(out, tuple) else _DEVICE
                return out
            if name == "__get__":  # a property: .device of a device tensor names the device
                out = func(*args, **kwargs)
                if not marked:
                    return out
                return _DEVICE if isinstance(out, torch.device) else _mark(out)
            if (name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"
                    and len(args) == 2 and isinstance(args[1], torch.Tensor)):
                # param.data = t (Module.cpu() / .to() swap a parameter's data in place): the
                # parameter now lives where t does
                out = func(*args, **kwargs)
                if on_device(args[1]):
                    _mark(args[0])
                else:
                    _unmark(args[0])
                return out
            crossing = name in CROSSING
            if not crossing:
                plain = [t for t in ins if not on_device(t) and t.dim() > 0]
                if marked and plain:
                    raise DeviceMismatch(
                        f"{name or func}: a {_describe(marked[0])} met a {_describe(plain[0])}. "
                        "On a GPU this fails with \"Expected all tensors to be on the same "
                        "device\": put the CPU tensor where the model is, with "
                        ".to(accelerator.device) or device=accelerator.device when you make it (a "
                        "prepared DataLoader's batches are moved for you). "
                        f"{VARIABLE}=1 made this CPU rank check it")
            out = func(*args, **kwargs)
            if crossing and ins and not on_device(ins[0]):
                return out  # indexing or copying into a CPU tensor leaves it there
            if marked or _names_the_device(kwargs.get("device")):
                _mark(out)
            return out

    return StrictDevice()


_ACTIVE: list = []
_DEVICE: Any = None  # the object a device tensor's .device returns: the device, by identity


def install() -> bool:
    """Enter the mode for the rest of this process's main thread, where GPU_LAB_STRICT_DEVICE
    asks for it and the rank has no GPU; True when installed."""
    if not wanted() or _ACTIVE:
        return bool(_ACTIVE)
    from .accelerator import device_kind

    if device_kind() != "cpu":  # CUDA checks devices itself
        return False
    m = mode()
    m.__enter__()
    _ACTIVE.append(m)
    _unchecked_loading()
    _copies_keep_their_device()
    return True


def _copies_keep_their_device() -> None:
    """copy.deepcopy(model) makes its parameters through Tensor._make_subclass, which no mode
    sees: a copy of a device tensor is marked as the tensor was (on a GPU it is a GPU tensor)."""
    import torch

    for cls in (torch.Tensor, torch.nn.Parameter):
        plain = cls.__dict__.get("__deepcopy__")
        if plain is None or getattr(plain, "_gpu_lab_marked", False):
            continue

        def deepcopy(self: Any, memo: dict, _plain: Any = plain) -> Any:
            out = _plain(self, memo)
            return _mark(out) if on_device(self) else out

        deepcopy._gpu_lab_marked = True  # type: ignore[attr-defined]
        cls.__deepcopy__ = deepcopy


def _unchecked_loading() -> None:
    """A DataLoader's fetch (decoding, augmenting, collating samples: CPU work whose tensors the
    prepared loader then moves) runs without the check, which would cost every sample's every
    operation a pass through Python and catch nothing there."""
    import torch
    from torch.utils.data._utils import fetch

    for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        plain = cls.fetch
        if getattr(plain, "_gpu_lab_unchecked", False):
            continue

        def unchecked(self: Any, *args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():
                return _plain(self, *args, **kwargs)

        unchecked._gpu_lab_unchecked = True  # type: ignore[attr-defined]
        cls.fetch = unchecked


__all__ = ["DeviceMismatch", "VARIABLE", "active", "device", "install", "mark", "mode", "on_device",
           "wanted"]
