"""Hardware advisor: the memory of one training step, which GPUs hold it, and what to switch on.

The usual picks go by model size (VGG16 → one P100 16 GB, ResNet-50 → four V100,
ViT → eight A100 80 GB) without saying why. Here the "why" is measured: one training step (forward,
loss, backward, optimizer step) runs as a dry run on fake tensors — they carry shapes, dtypes and
sizes but no data, so ResNet-50 at batch 256 costs seconds of CPU and no memory — while torch's
MemTracker follows every allocation and free, by kind: parameters, gradients, optimizer state,
activations. The peak it reports is what the step needs on a GPU, before the CUDA context and
allocator headroom (hardware.usable_bytes). `measure_memory` runs the same step for real in a
launched process (a GPU: torch.cuda.max_memory_allocated; a CPU: the profiler's allocator trace).
"""
from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass, field

from ..units import fmt_bytes
from ..hardware import GPU_CLASSES, ARTICLE_PICKS, GPUClass, by_name, usable_bytes
from .cudasafe import cuda_probe_off

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass
class MemoryEstimate:
    """One training step's memory, by kind, at its peak. Bytes."""

    model: str
    image_size: int
    batch_size: int
    precision: str
    optimizer: str
    num_classes: int
    activation_checkpointing: bool
    parameters_bytes: int      # weights and buffers (BatchNorm statistics)
    gradients_bytes: int       # all gradients, as they exist at the end of backward
    optimizer_bytes: int       # optimizer state (AdamW: two moments per weight)
    activations_bytes: int     # what forward kept for backward plus backward's temporaries, at the peak
    inputs_bytes: int          # the batch itself
    peak_bytes: int            # the peak the dry run saw (components above are at that moment,
                               # except gradients, which are given in full)
    method: str = "fake-tensor dry run (torch MemTracker)"

    @property
    def states_bytes(self) -> int:
        """What does not grow with the batch: weights, gradients, optimizer state."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def per_sample_bytes(self) -> float:
        """Activations and inputs per sample: what grows with the batch."""
        return (self.activations_bytes + self.inputs_bytes) / self.batch_size

    def peak_for_batch(self, batch_size: int, zero_shards: int = 1) -> int:
        """The peak at another per-device batch (activations scale linearly with it), optionally
        with the optimizer state sharded over `zero_shards` ranks (ZeRO stage 1)."""
        states = self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes / zero_shards
        return int(max(states + self.per_sample_bytes * batch_size,
                       self.peak_bytes if batch_size == self.batch_size and zero_shards == 1 else 0))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["states_bytes"] = self.states_bytes
        d["per_sample_bytes"] = self.per_sample_bytes
        return d

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.parameters_bytes), ("gradients", self.gradients_bytes),
                ("optimizer state", self.optimizer_bytes), ("activations", self.activations_bytes),
                ("inputs", self.inputs_bytes), ("peak of the step", self.peak_bytes)]

    def __str__(self) -> str:
        head = (f"{self.model} @ {self.image_size}px, batch {self.batch_size}, {self.precision}, "
                f"{self.optimizer}{', activation checkpointing' if self.activation_checkpointing else ''}"
                f" — {self.method}")
        return "\n".join([head] + [f"  {k:<18} {fmt_bytes(v):>11}" for k, v in self.rows()])


@dataclass
class GPUFit:
    gpu: str
    memory_gb: float
    usable_bytes: int
    fits_one: bool
    min_gpus: int | None       # data-parallel GPUs needed to hold the global batch (None: > max)
    per_gpu_batch: int | None
    article_pick: str | None      # "usual pick: 4× V100 32GB" where this class is the model's


@dataclass
class Remedy:
    switch: str                # the TrainConfig change
    peak_bytes: int
    saves_bytes: int
    cost: str                  # what it costs
    fits: list[str] = field(default_factory=list)   # GPU classes that one GPU of holds it then


@dataclass
class Advice:
    estimate: MemoryEstimate
    fits: list[GPUFit]
    target: str | None
    remedies: list[Remedy]

    def __repr__(self) -> str:
        e = self.estimate
        return (f"Advice({e.model} @ {e.image_size}px, batch {e.batch_size}, {e.precision}: peak "
                f"{fmt_bytes(e.peak_bytes)}; one GPU holds it: {', '.join(self.fitting()) or 'none'})")

    def fitting(self) -> list[str]:
        return [f.gpu for f in self.fits if f.fits_one]

    def to_dict(self) -> dict:
        return {"estimate": self.estimate.to_dict(), "fits": [asdict(f) for f in self.fits],
                "target": self.target, "remedies": [asdict(r) for r in self.remedies]}

    def __str__(self) -> str:
        lines = [str(self.estimate), "",
                 f"  {'GPU':<12} {'usable':>10}  one GPU?  GPUs for batch {self.estimate.batch_size}"]
        for f in self.fits:
            n = "—" if f.min_gpus is None else f"{f.min_gpus} (batch {f.per_gpu_batch} each)"
            lines.append(f"  {f.gpu:<12} {fmt_bytes(f.usable_bytes):>10}  {'yes' if f.fits_one else 'no':<8}  {n}"
                         + (f"   ← {f.article_pick}" if f.article_pick else ""))
        if self.remedies:
            lines += ["", f"Does not fit one {self.target}: what to switch on, with its peak:"]
            for r in self.remedies:
                lines.append(f"  {r.switch:<44} {fmt_bytes(r.peak_bytes):>10}  (−{fmt_bytes(r.saves_bytes)}; "
                             f"{r.cost}) fits: {', '.join(r.fits[:3]) or 'none'}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = html.escape
        est = self.estimate
        out = [f"<div><b>{e(est.model)}</b> @ {est.image_size}px, batch {est.batch_size}, "
               f"{e(est.precision)}, {e(est.optimizer)} <i>({e(est.method)})</i>",
               "<table><tr>" + "".join(f"<th>{e(k)}</th>" for k, _ in est.rows()) + "</tr><tr>"
               + "".join(f"<td>{fmt_bytes(v)}</td>" for _, v in est.rows()) + "</tr></table>",
               "<table><tr><th>GPU</th><th>usable</th><th>one GPU?</th>"
               f"<th>GPUs for batch {est.batch_size}</th><th>Usual pick</th></tr>"]
        for f in self.fits:
            n = "—" if f.min_gpus is None else f"{f.min_gpus} (batch {f.per_gpu_batch} each)"
            color = "#1a7f37" if f.fits_one else "#b00"
            out.append(f"<tr><td>{e(f.gpu)}</td><td>{fmt_bytes(f.usable_bytes)}</td>"
                       f"<td style='color:{color}'>{'yes' if f.fits_one else 'no'}</td><td>{e(n)}</td>"
                       f"<td>{e(f.article_pick or '')}</td></tr>")
        out.append("</table>")
        if self.remedies:
            out.append(f"<b>Does not fit one {e(self.target or '')}:</b><ol>")
            out += [f"<li><code>{e(r.switch)}</code>: peak {fmt_bytes(r.peak_bytes)} "
                    f"(−{fmt_bytes(r.saves_bytes)}; {e(r.cost)}); fits {e(', '.join(r.fits[:3]) or 'none')}</li>"
                    for r in self.remedies]
            out.append("</ol>")
        return "".join(out) + "</div>"


# --------------------------------------------------------------------------------- dry run

def _check(model: str, image_size: int, batch_size: int, precision: str, optimizer: str,
           num_classes: int) -> None:
    from ..models import check_input

    check_input(model, num_classes, image_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: got {batch_size!r}; accepted: an int >= 1")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}; accepted: {', '.join(map(repr, PRECISIONS))}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: got {optimizer!r}; accepted: {', '.join(map(repr, OPTIMIZERS))}")


def _make_optimizer(name: str, params):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def _train_step(model, opt, x, y, precision: str) -> None:
    import contextlib

    import torch
    import torch.nn.functional as F

    cast = (torch.autocast(x.device.type, dtype=torch.bfloat16) if precision in ("bf16", "fp16")
            else contextlib.nullcontext())  # fp16 takes the bytes bf16 does
    with cast:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fake_model(mode, name: str, num_classes: int, image_size: int):
    """`name` with fake parameters. Most models build directly under fake mode; those whose
    initialisation looks at values (ViT's truncated-normal init asks `mask.any()`) are built for
    real on the CPU first — a transient copy of the weights — and then converted."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.utils._python_dispatch import _disable_current_modes

    from ..models import build

    try:
        return build(name, num_classes=num_classes, image_size=image_size)
    except DataDependentOutputException:
        pass
    with _disable_current_modes(), torch.no_grad():
        net = build(name, num_classes=num_classes, image_size=image_size)
        for module in net.modules():
            for key, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[key] = torch.nn.Parameter(mode.from_tensor(p.detach()),
                                                                 requires_grad=p.requires_grad)
            for key, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[key] = mode.from_tensor(b)
    return net


def estimate_memory(model: str, image_size: int = 224, batch_size: int = 32,
                    precision: str = "fp32", optimizer: str = "adamw", num_classes: int = 1000,
                    activation_checkpointing: bool = False) -> MemoryEstimate:
    """The memory of one training step, from a dry run on fake tensors on the CPU.

    The optimizer state is created first (an optimizer step on zero gradients), so the tracked step
    is a steady-state one: weights, optimizer state, then forward activations, gradients, the
    update. Runs in seconds for ResNet-50; allocates no real tensor memory; never touches CUDA.
    It runs in a forked child (see isolate.py): a backward pass on fake tensors would otherwise
    leave this process unable to fork training workers.
    """
    _check(model, image_size, batch_size, precision, optimizer, num_classes)
    # import here what the child needs, so that it imports nothing after the fork
    import torch  # noqa: F401
    import torch._subclasses.fake_tensor  # noqa: F401
    import torch.distributed._tools.mem_tracker  # noqa: F401

    from .. import models  # noqa: F401
    from .isolate import in_child

    if model not in ("tiny_cnn", "tiny_resnet", "tiny_vit"):
        import torchvision.models  # noqa: F401
    if activation_checkpointing:
        from ..train import activation  # noqa: F401
    return in_child(_estimate, model, image_size, batch_size, precision, optimizer, num_classes,
                    activation_checkpointing)


def _estimate(model: str, image_size: int, batch_size: int, precision: str, optimizer: str,
              num_classes: int, activation_checkpointing: bool) -> MemoryEstimate:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as e:  # pragma: no cover - torch >= 2.5 ships it
        raise RuntimeError(f"estimate_memory needs torch.distributed._tools.mem_tracker (torch >= 2.5; "
                           f"this is {torch.__version__}): {e}") from e

    # FakeTensorMode (every op), AdamW.step and torch.utils.checkpoint ask
    # torch.cuda.is_available(), which would poison the kernel's later forks: see cudasafe
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with cuda_probe_off(), mode:
        net = _fake_model(mode, model, num_classes, image_size)
        net.train()
        if activation_checkpointing:
            from ..train.activation import enable

            enable(net)
        opt = _make_optimizer(optimizer, net.parameters())
        for p in net.parameters():  # create the optimizer state (a steady-state step follows)
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        x = torch.randn(batch_size, 3, image_size, image_size)
        y = torch.randint(0, num_classes, (batch_size,))
        mt = MemTracker()
        mt.track_external(net, opt, x, y)
        with mt:
            _train_step(net, opt, x, y, precision)
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))
        grads = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)

    def get(kind: str) -> int:
        return int(sum(v for k, v in peak.items() if getattr(k, "value", k) == kind))

    return MemoryEstimate(
        model=model, image_size=image_size, batch_size=batch_size, precision=precision,
        optimizer=optimizer, num_classes=num_classes,
        activation_checkpointing=activation_checkpointing,
        parameters_bytes=get("Parameter") + get("Buffer"), gradients_bytes=int(grads),
        optimizer_bytes=get("Optstate"), activations_bytes=get("Activation") + get("Temp"),
        inputs_bytes=get("Other"), peak_bytes=get("Total"))


# ------------------------------------------------------------------------- the real thing

def _measure_worker(model: str, image_size: int, batch_size: int, precision: str,
                    optimizer: str, num_classes: int, steps: int) -> dict:
    """In a launched rank: run `steps` real training steps and report the allocator's peak."""
    import json
    import os
    import tempfile

    import torch

    from ..rank.accelerator import device_kind
    from ..models import build

    torch.manual_seed(0)
    if device_kind() == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        net = build(model, num_classes=num_classes, image_size=image_size).to(dev)
        opt = _make_optimizer(optimizer, net.parameters())
        x = torch.randn(batch_size, 3, image_size, image_size, device=dev)
        y = torch.randint(0, num_classes, (batch_size,), device=dev)
        for _ in range(steps):
            _train_step(net, opt, x, y, precision)
        torch.cuda.synchronize(dev)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(dev)), "device": "cuda",
                "method": "torch.cuda.max_memory_allocated"}
    # CPU: the profiler's memory events carry the CPU allocator's running total
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        net = build(model, num_classes=num_classes, image_size=image_size)
        opt = _make_optimizer(optimizer, net.parameters())
        x = torch.randn(batch_size, 3, image_size, image_size)
        y = torch.randint(0, num_classes, (batch_size,))
        for _ in range(steps):
            _train_step(net, opt, x, y, precision)
        del net, opt, x, y
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    return {"peak_bytes": int(max(totals)) if totals else None, "device": "cpu",
            "method": "torch.profiler(profile_memory=True): max 'Total Allocated'"}


def measure_memory(model: str, image_size: int = 224, batch_size: int = 32,
                   precision: str = "fp32", optimizer: str = "adamw", num_classes: int = 1000,
                   steps: int = 2, timeout: float = 900) -> dict:
    """Run `steps` real training steps in one launched process (a GPU if NVML sees one, else the
    CPU) and return {"peak_bytes", "device", "method"}. The kernel stays CUDA-free."""
    _check(model, image_size, batch_size, precision, optimizer, num_classes)
    from ..launch import launch

    run = launch(_measure_worker, model, image_size, batch_size, precision, optimizer,
                 num_classes, steps, num_processes=1, name=f"measure-memory-{model}")
    return run.result(timeout=timeout)


# ------------------------------------------------------------------------------- advice

def _fits(est: MemoryEstimate, gpus: list[GPUClass], max_gpus: int) -> list[GPUFit]:
    out = []
    seed = ARTICLE_PICKS.get(est.model)
    for g in gpus:
        usable = usable_bytes(g)
        n_needed = per = None
        for n in range(1, max_gpus + 1):
            b = math.ceil(est.batch_size / n)
            if est.peak_for_batch(b) <= usable:
                n_needed, per = n, b
                break
        pick = f"usual pick: {seed[0]}× {seed[1]}" if seed and seed[1] == g.name else None
        out.append(GPUFit(g.name, g.memory_gb, usable, est.peak_bytes <= usable, n_needed, per, pick))
    return out


def _remedies(est: MemoryEstimate, gpus: list[GPUClass], measure_switches: bool) -> list[Remedy]:
    def fits(peak: int) -> list[str]:
        return [g.name for g in gpus if usable_bytes(g) >= peak]

    out = []
    b = est.batch_size
    if b > 1:
        half = est.peak_for_batch(b // 2)
        out.append(Remedy(f"batch_size={b // 2}, grad_accum_steps=2", half, est.peak_bytes - half,
                          "none for the math (same global batch); a little speed", fits(half)))
    if est.precision in ("fp32", "tf32"):
        bf = (estimate_memory(est.model, est.image_size, b, "bf16", est.optimizer, est.num_classes,
                              est.activation_checkpointing).peak_bytes
              if measure_switches else int(est.peak_bytes - 0.4 * est.activations_bytes))
        out.append(Remedy("mixed_precision='bf16'", bf, est.peak_bytes - bf,
                          "none on Ampere+ (faster); check the loss curve", fits(bf)))
    if not est.activation_checkpointing:
        try:
            ac = (estimate_memory(est.model, est.image_size, b, est.precision, est.optimizer,
                                  est.num_classes, True).peak_bytes
                  if measure_switches else int(est.peak_bytes - 0.4 * est.activations_bytes))
        except ImportError:
            ac = int(est.peak_bytes - 0.4 * est.activations_bytes)
        out.append(Remedy("activation_checkpointing=True", ac, est.peak_bytes - ac,
                          "≈25% more compute", fits(ac)))
    if est.optimizer_bytes:
        z = est.peak_for_batch(b, zero_shards=4) if b else est.peak_bytes
        z = min(z, est.peak_bytes - int(est.optimizer_bytes * 3 / 4))
        out.append(Remedy("zero=True over 4 GPUs", z, est.peak_bytes - z,
                          "needs ≥ 2 GPUs; a little communication", fits(z)))
    return sorted(out, key=lambda r: r.peak_bytes)


def advise(model: str, image_size: int = 224, batch_size: int = 32, precision: str = "fp32",
           optimizer: str = "adamw", num_classes: int = 1000, *, target: str | None = None,
           gpus: list[str] | None = None, max_gpus: int = 8, measure_switches: bool = True,
           estimate: MemoryEstimate | None = None) -> Advice:
    """Which GPU classes hold one training step, how many of each the global batch needs, and —
    where one `target` GPU (default: the usual pick for the model, else the smallest class) is not
    enough — what to switch on, each with its estimated peak (measured by more dry runs when
    `measure_switches`)."""
    est = estimate or estimate_memory(model, image_size, batch_size, precision, optimizer,
                                      num_classes)
    classes = [by_name(g) for g in gpus] if gpus else list(GPU_CLASSES)
    fits = _fits(est, classes, max_gpus)
    if target is None:
        seed = ARTICLE_PICKS.get(model)
        target = seed[1] if seed else min(classes, key=lambda g: g.memory_gb).name
    tgt = by_name(target)
    remedies = [] if est.peak_bytes <= usable_bytes(tgt) else _remedies(est, classes, measure_switches)
    return Advice(est, fits, tgt.name, remedies)


__all__ = ["estimate_memory", "measure_memory", "advise", "MemoryEstimate", "Advice", "GPUFit",
           "Remedy", "PRECISIONS", "OPTIMIZERS"]
