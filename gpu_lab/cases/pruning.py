"""Structured channel pruning that really removes channels, and the three numbers that judge it:
parameters, FLOPs and latency.

Masking weights to zero (torch.nn.utils.prune) leaves every tensor its size: a dense kernel runs just
as long. Removing whole output channels of a convolution makes the convolution, its BatchNorm and
the next layer's input smaller, and so the computation. `prune_channels` keeps, in each convolution,
the output channels whose filters have the largest L1 norm (Li et al., "Pruning Filters for Efficient
ConvNets") and rebuilds the layers at the new width, for a plain chain conv → BN → ... → Linear head
(VGG-style stacks, gpu_lab's tiny_cnn). Networks with residual additions need the channels of every
branch that meets at an addition pruned together; they are refused with that reason.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one forward pass on `x` (a multiply-add counts 2), as torch's FlopCounterMode
    counts them (convolutions and matrix products)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    model.train(was_training)
    return int(counter.get_total_flops())


def latency(model: nn.Module, x: torch.Tensor, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of one inference forward pass on `x` (eval mode, no autograd); on a GPU each
    pass is synchronised, since kernels run asynchronously."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    was_training = model.training
    model.eval()
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            model(x)
            sync()  # CPU-GPU sync point: the kernels must have finished to be timed
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    model.train(was_training)
    return statistics.median(times)


def _chain(model: nn.Module) -> tuple[list[tuple[str, nn.Conv2d, str | None]], tuple[str, nn.Linear]]:
    """[(conv name, conv, following BatchNorm name)], and the first Linear after the last conv."""
    convs: list[tuple[str, nn.Conv2d, str | None]] = []
    head = None
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            if head is not None:
                raise ValueError(f"prune_channels: conv {name!r} comes after the linear layer "
                                 f"{head[0]!r}; expected convolutions, then one linear head")
            if m.groups != 1:
                raise ValueError(f"prune_channels: conv {name!r} has groups={m.groups}; only "
                                 "plain convolutions (groups=1) are supported")
            if convs and m.in_channels != convs[-1][1].out_channels:
                raise ValueError(f"prune_channels: conv {name!r} takes {m.in_channels} channels but "
                                 f"the previous conv {convs[-1][0]!r} gives "
                                 f"{convs[-1][1].out_channels}: not a plain chain (residual "
                                 "connections need the channels of both branches pruned together)")
            convs.append((name, m, None))
        elif isinstance(m, nn.BatchNorm2d) and convs and convs[-1][2] is None and head is None:
            if m.num_features != convs[-1][1].out_channels:
                raise ValueError(f"prune_channels: BatchNorm {name!r} has {m.num_features} features "
                                 f"after conv {convs[-1][0]!r} with {convs[-1][1].out_channels}")
            convs[-1] = (convs[-1][0], convs[-1][1], name)
        elif isinstance(m, nn.Linear) and convs and head is None:
            head = (name, m)
    if not convs or head is None:
        raise ValueError("prune_channels: expected a chain of Conv2d layers followed by a Linear "
                         f"head; found {len(convs)} conv(s) and {'a' if head else 'no'} linear layer")
    merge = _merging_op(model)
    if merge is not None:
        raise ValueError(f"prune_channels: the forward pass merges branches ({merge}); residual "
                         "networks need the channels of every branch that meets there pruned "
                         "together, which this plain-chain pruner does not do")
    return convs, head


def _merging_op(model: nn.Module) -> str | None:
    """The first addition or concatenation of tensors in the traced forward pass, if any (a model
    that torch.fx cannot trace is taken as a chain; the checks above still apply)."""
    import operator

    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - untraceable control flow: nothing to learn from the graph
        return None
    merges = {operator.add, operator.iadd, torch.add, torch.cat, torch.stack}
    for node in graph.nodes:
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if node.op == "call_function" and node.target in merges and (
                len(tensors) > 1 or node.target in (torch.cat, torch.stack)):
            return f"{node.target.__name__} at {node.name}"
        if node.op == "call_method" and node.target in ("add", "add_") and len(tensors) > 1:
            return f"{node.target} at {node.name}"
    return None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def prune_channels(model: nn.Module, ratio: float = 0.5) -> nn.Module:
    """A copy of `model` with `ratio` of every convolution's output channels removed (those with the
    smallest filter L1 norm), BatchNorms and the next layer's inputs cut to match. The copy is
    smaller in parameters, FLOPs and time; fine-tune it to win back the accuracy."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"prune_channels: ratio={ratio!r}; expected 0 <= ratio < 1 (the fraction of "
                         "channels removed)")
    pruned = copy.deepcopy(model)
    convs, (head_name, head) = _chain(pruned)
    keep_in = None
    for name, conv, bn_name in convs:
        n_keep = max(1, round(conv.out_channels * (1.0 - ratio)))
        norms = conv.weight.detach().abs().sum(dim=(1, 2, 3))
        keep = torch.sort(torch.topk(norms, n_keep).indices).values  # original channel order
        new = nn.Conv2d(conv.in_channels if keep_in is None else len(keep_in), n_keep,
                        conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                        bias=conv.bias is not None, padding_mode=conv.padding_mode)
        w = conv.weight.detach()[keep]
        if keep_in is not None:
            w = w[:, keep_in]
        with torch.no_grad():
            new.weight.copy_(w)
            if conv.bias is not None:
                new.bias.copy_(conv.bias.detach()[keep])
        _set(pruned, name, new.to(conv.weight.device))
        if bn_name is not None:
            bn = pruned.get_submodule(bn_name)
            nbn = nn.BatchNorm2d(n_keep, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
            with torch.no_grad():
                if bn.affine:
                    nbn.weight.copy_(bn.weight[keep])
                    nbn.bias.copy_(bn.bias[keep])
                if bn.track_running_stats:
                    nbn.running_mean.copy_(bn.running_mean[keep])
                    nbn.running_var.copy_(bn.running_var[keep])
                    nbn.num_batches_tracked.copy_(bn.num_batches_tracked)
            _set(pruned, bn_name, nbn.to(conv.weight.device))
        keep_in = keep
    last = convs[-1][1].out_channels
    if head.in_features % last:
        raise ValueError(f"prune_channels: head {head_name!r} takes {head.in_features} features, "
                         f"not a multiple of the last conv's {last} channels")
    spatial = head.in_features // last  # flatten after a spatial map: channel-major blocks
    cols = (keep_in[:, None] * spatial + torch.arange(spatial, device=keep_in.device)[None]).flatten()
    new_head = nn.Linear(len(cols), head.out_features, bias=head.bias is not None)
    with torch.no_grad():
        new_head.weight.copy_(head.weight.detach()[:, cols])
        if head.bias is not None:
            new_head.bias.copy_(head.bias.detach())
    _set(pruned, head_name, new_head.to(head.weight.device))
    return pruned


def conv_widths(model: nn.Module) -> list[int]:
    """Output channels of every Conv2d, in order."""
    return [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]


def compare(models: dict[str, nn.Module], x: torch.Tensor, repeats: int = 20) -> dict[str, dict[str, Any]]:
    """Parameters, FLOPs and latency of each model on the same input, timed in alternation (a
    machine's speed drifts; alternating keeps the comparison fair)."""
    out = {k: {"params": count_params(m), "flops": count_flops(m, x), "latency": []}
           for k, m in models.items()}
    for _ in range(3):
        for k, m in models.items():
            out[k]["latency"].append(latency(m, x, repeats=max(1, repeats // 3)))
    for k in out:
        out[k]["latency_s"] = statistics.median(out[k].pop("latency"))
    return out


__all__ = ["count_params", "count_flops", "latency", "prune_channels", "conv_widths", "compare"]
