"""GPU training throughput: ResNet-50 images/s in fp32, TF32 and bf16, with channels_last and
torch.compile, its MFU, next to NVIDIA's published A100 80GB figures.

NVIDIA's DeepLearningExamples (PyTorch resnet50v1.5, DGX A100 80GB, batch 256, DALI) publishes
938 img/s per GPU in TF32 and 2,470 img/s with AMP. This benchmark trains on synthetic tensors that
already sit on the GPU, so it measures the model and the GPU alone — no loader, no disk; a run that
falls far below it is data- or communication-bound (gpu_lab.diagnostics.find_bottleneck).

MFU (model FLOPs utilisation) = achieved FLOP/s ÷ the GPU's dense peak for the precision; the
FLOPs of one training step are counted by torch.utils.flop_counter (forward + backward, ≈ 3× the
forward: 24.3 GFLOP per 224-px ResNet-50 image).

Without a GPU it runs a CPU mode — a tiny model at 32 px, fp32 and bf16 — so that the code path
is tested anywhere; its numbers say nothing about GPUs.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass, field

#: DeepLearningExamples PyTorch resnet50v1.5, training performance, DGX A100 (8x A100 80GB),
#: batch 256 per GPU, img/s per GPU
NVIDIA_A100_80GB = {"tf32": 938.0, "amp": 2470.0}
NVIDIA_SOURCE = ("NVIDIA DeepLearningExamples, PyTorch resnet50v1.5, DGX A100 80GB, batch 256: "
                 "938 img/s TF32, 2,470 img/s AMP per GPU")

GPU_VARIANTS = ("fp32", "tf32", "bf16", "tf32+compile", "bf16+compile")
CPU_VARIANTS = ("fp32", "bf16")


@dataclass
class BenchRow:
    variant: str
    precision: str
    channels_last: bool
    compile: bool
    images_per_s: float
    step_ms: float
    mfu: float | None
    compile_s: float | None
    peak_memory_bytes: int | None
    nvidia_reference: float | None     # NVIDIA's A100 80GB figure for this precision


@dataclass
class GPUBenchResult:
    device: str
    gpu_name: str | None
    model: str
    image_size: int
    batch_size: int
    steps: int
    flops_per_image: float
    peak_tflops: dict
    rows: list[BenchRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"{self.model} @ {self.image_size}px, batch {self.batch_size}, {self.steps} timed "
                 f"steps on {self.gpu_name or self.device} ({self.flops_per_image / 1e9:.1f} GFLOP "
                 f"per training image)",
                 f"  {'variant':<14} {'img/s':>9} {'step ms':>9} {'MFU':>7} {'compile s':>10} "
                 f"{'A100 80GB (NVIDIA)':>19} {'ratio':>7}"]
        for r in self.rows:
            mfu = f"{r.mfu:7.1%}" if r.mfu is not None else f"{'—':>7}"
            comp = f"{r.compile_s:10.1f}" if r.compile_s is not None else f"{'—':>10}"
            ref = f"{r.nvidia_reference:19,.0f}" if r.nvidia_reference else f"{'—':>19}"
            ratio = (f"{r.images_per_s / r.nvidia_reference:7.2f}" if r.nvidia_reference else f"{'—':>7}")
            lines.append(f"  {r.variant:<14} {r.images_per_s:9.1f} {r.step_ms:9.1f} {mfu} {comp} {ref} {ratio}")
        lines.append(f"  reference: {NVIDIA_SOURCE}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _gpu_name() -> str | None:
    from ..telemetry.probe import nvml_session

    with nvml_session() as (nv, _):
        try:
            idx = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            name = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(idx))
            return name.decode() if isinstance(name, bytes) else name
        except Exception:  # noqa: BLE001 - no NVML, no GPU, a UUID in CUDA_VISIBLE_DEVICES
            return None


def training_flops(model: str, image_size: int, num_classes: int = 1000) -> float:
    """FLOPs of one training step per image (forward + backward), counted on the meta device, in
    a forked child (a backward pass on meta tensors starts autograd threads that would break this
    process's later forks; see isolate.py)."""
    import torch  # noqa: F401  (imported before the fork)
    from torch.utils import flop_counter  # noqa: F401

    from .. import models  # noqa: F401
    from .isolate import in_child

    if model not in ("tiny_cnn", "tiny_resnet", "tiny_vit"):
        import torchvision.models  # noqa: F401
    return in_child(_training_flops, model, image_size, num_classes)


def _training_flops(model: str, image_size: int, num_classes: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ..models import build

    from .cudasafe import cuda_probe_off

    with cuda_probe_off(), torch.device("meta"):
        net = build(model, num_classes=num_classes, image_size=image_size)
        x = torch.randn(1, 3, image_size, image_size)
        y = torch.randint(0, num_classes, (1,))
        with FlopCounterMode(display=False) as fc:
            F.cross_entropy(net(x), y).backward()
    return float(fc.get_total_flops())


def _precision(variant: str) -> str:
    return variant.split("+")[0]


def _run_variant(variant: str, model: str, image_size: int, batch_size: int, steps: int,
                 warmup: int, channels_last: bool, device: str, num_classes: int) -> tuple[float, float | None, int | None]:
    """(seconds per step, compile seconds, peak memory) of one variant."""
    import torch
    import torch.nn.functional as F

    from ..models import build

    prec = _precision(variant)
    use_compile = "compile" in variant
    if device == "cuda":
        # TF32: tensor cores for fp32 matmuls/convolutions (Ampere+); fp32 means it is off
        tf32 = prec in ("tf32", "bf16")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True  # autotune convolution algorithms for this shape
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dev = torch.device(device)
    net = build(model, num_classes=num_classes, image_size=image_size).to(dev)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, 3, image_size, image_size, device=dev).to(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch_size,), device=dev)
    cast = (torch.autocast(device, dtype=torch.bfloat16) if prec == "bf16"
            else contextlib.nullcontext())

    def step(m):  # x, y, opt: deleted at the end, after the last step (ruff sees the del)
        with cast:
            loss = F.cross_entropy(m(x), y)  # noqa: F821
        loss.backward()
        opt.step()  # noqa: F821
        opt.zero_grad(set_to_none=True)  # noqa: F821

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    compile_s = None
    fwd = net
    if use_compile:
        fwd = torch.compile(net)
        t0 = time.perf_counter()
        step(fwd)  # the first call compiles
        sync()
        compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        step(fwd)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(fwd)
    sync()
    dt = (time.perf_counter() - t0) / steps
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    del net, opt, x, y, fwd
    if device == "cuda":
        torch.cuda.empty_cache()
    return dt, compile_s, peak


def gpu_benchmark(model: str | None = None, batch_size: int | None = None,
                  image_size: int | None = None, steps: int | None = None, warmup: int | None = None,
                  variants: list[str] | tuple[str, ...] | None = None, channels_last: bool = True,
                  cpu: bool | None = None, compile: bool = True,
                  num_classes: int = 1000) -> GPUBenchResult:
    """Train `model` on synthetic on-device tensors in each variant and return img/s and MFU.

    GPU defaults: resnet50, batch 256, 224 px, 30 steps after 10 warm-up, variants fp32, tf32, bf16,
    tf32+compile, bf16+compile. `cpu=True` (automatic without a GPU): tiny_resnet at 32 px, batch
    32, fp32 and bf16, compile off. Run it in a script or a launched process: it initialises CUDA
    in the calling process (gpu-lab bench gpu, bench/gpu_train.py).
    """
    from ..telemetry.probe import gpu_count

    if cpu is None:
        cpu = gpu_count() == 0
    if not cpu and "ipykernel" in sys.modules:
        raise RuntimeError("gpu_benchmark initialises CUDA in the calling process; from a notebook, "
                           "run `!gpu-lab bench gpu` or gpu_lab.launch(gpu_benchmark, "
                           "num_processes=1).result() so that the kernel stays CUDA-free")
    device = "cpu" if cpu else "cuda"
    model = model or ("tiny_resnet" if cpu else "resnet50")
    image_size = image_size or (32 if cpu else 224)
    batch_size = batch_size or (32 if cpu else 256)
    steps = steps or (5 if cpu else 30)
    warmup = 2 if warmup is None and cpu else (10 if warmup is None else warmup)
    allowed = CPU_VARIANTS + ("fp32+compile", "bf16+compile") if cpu else GPU_VARIANTS + ("fp32+compile",)
    if variants is None:
        variants = CPU_VARIANTS if cpu else GPU_VARIANTS
    if not compile:
        variants = [v for v in variants if "compile" not in v]
    for v in variants:
        if v not in allowed:
            raise ValueError(f"variant: got {v!r}; accepted on {device}: {', '.join(map(repr, allowed))}")
    flops = training_flops(model, image_size, num_classes)
    name = None if cpu else _gpu_name()
    peaks: dict = {}
    gpu_class = None
    if name:
        from ..hardware import by_name

        try:
            gpu_class = by_name(name)
            peaks = {p: gpu_class.peak_tflops(p) for p in ("fp32", "tf32", "bf16")}
        except ValueError:
            gpu_class = None
    res = GPUBenchResult(device, name, model, image_size, batch_size, steps, flops, peaks)
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        res.notes.append("NVIDIA_TF32_OVERRIDE=0 is set: the tf32 rows run as plain fp32")
    if cpu:
        res.notes.append("CPU mode (no GPU): a tiny model, to test the code path; the A100 figures "
                         "are for ResNet-50 on a GPU and are not comparable")
    for v in variants:
        dt, comp, peak = _run_variant(v, model, image_size, batch_size, steps, warmup,
                                      channels_last, device, num_classes)
        ips = batch_size / dt
        prec = _precision(v)
        peak_t = peaks.get(prec)
        mfu = ips * flops / (peak_t * 1e12) if peak_t else None
        ref = None
        if model == "resnet50" and image_size == 224:
            ref = NVIDIA_A100_80GB["amp"] if prec == "bf16" else (
                NVIDIA_A100_80GB["tf32"] if prec == "tf32" else None)
        res.rows.append(BenchRow(v, prec, channels_last, "compile" in v, ips, dt * 1e3, mfu, comp,
                                 peak, ref))
    return res


__all__ = ["gpu_benchmark", "GPUBenchResult", "BenchRow", "training_flops", "NVIDIA_A100_80GB",
           "NVIDIA_SOURCE"]
