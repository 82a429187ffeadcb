"""The steps of bench/gpu_check.py: what runs on the GPU machine, and each step's CPU-safe part.

Each step is one function of a `Ctx`. With `ctx.dry` (the dry run, on a CPU) it runs its CPU-safe
part: the same code path where one exists without a GPU, smaller; where a piece cannot exist on a
CPU, a stand-in named as such in its check. The runner starts every step in a process of its own
(a CUDA error, a hang or a crash stays in that step), so a step may initialise CUDA; but a step
that launches runs forks them, so it launches before its first CUDA call of its own.

A step records what it measured with `ctx.record(...)`, its verdicts with `ctx.check(name, ok,
detail)` (a failed check fails the step but the step goes on), and one line for the summary with
`ctx.summary(...)`. An exception ends the step; what it recorded until then is kept.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GiB = 1024 ** 3


@dataclass
class Ctx:
    dry: bool
    work: Path                      # this step's scratch folder
    results: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    line: str = ""

    def record(self, **values: Any) -> None:
        self.results.update(values)

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)[:2000]})
        print(f"  check {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return bool(ok)

    def summary(self, text: str) -> None:
        self.line = text

    @property
    def cores(self) -> int:
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    cap_s: int           # the most it may take on the GPU machine
    run: Callable[[Ctx], None]
    cpu_part: str        # what the dry run does


# --------------------------------------------------------------------------------------- helpers

def run_cells(ctx: Ctx, cells: list[str], timeout: int = 300) -> list[str]:
    """Execute `cells` in a real Jupyter kernel (nbclient); each cell's stdout."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(ctx.work)}}).execute()
    return ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            for c in nb.cells]


def last_json(text: str) -> Any:
    """The JSON document a program printed last (one line, or an indented block)."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                return json.loads("\n".join(lines[i:]))
    raise ValueError(f"no JSON in the output: {text[-2000:]}")


def python(*args: str, timeout: float | None = None) -> str:
    """Run a Python script of this repository in a child process; its stdout (raises on failure)."""
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    sys.stdout.write(out.stdout[-20000:])
    sys.stdout.write(out.stderr[-20000:])
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {out.returncode}: {out.stderr[-3000:]}")
    return out.stdout


def train_config(ctx: Ctx, **kw: Any):
    """A TrainConfig for a check's run: no TensorBoard, no resume, no evaluation, every step
    reported, output in the step's folder."""
    from gpu_lab.config import TrainConfig

    base = dict(epochs=None, num_processes=1, tensorboard=False, resume=False, log_every=1,
                eval_every=10**9, checkpoint_every=0, output_dir=str(ctx.work / "runs" / "out"))
    base.update(kw)
    return TrainConfig(**base)


def train_and_tell(config) -> dict:
    """train_classifier, plus what the rank saw of CUDA (the launch and loader steps launch it)."""
    import torch

    from gpu_lab.train import train_classifier

    summary = train_classifier(config)
    summary["cuda_device"] = torch.cuda.get_device_name() if torch.cuda.is_initialized() else None
    summary["bad_fork"] = bool(torch._C._cuda_isInBadFork())
    return summary


def train_one_step(batch_size: int, model: str = "resnet50", image_size: int = 224,
                   cap_bytes: int | None = None) -> float:
    """One training step on random data: out of memory when the batch's activations do not fit
    (on a CPU, `cap_bytes` makes its allocator behave like a small GPU's)."""
    import torch
    import torch.nn.functional as F

    import gpu_lab
    from gpu_lab.diagnostics import memory_cap, note
    from gpu_lab.models import build

    acc = gpu_lab.accelerator()
    torch.manual_seed(0)
    net = build(model, num_classes=10, image_size=image_size)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net, opt = acc.prepare(net, opt)
    note(batch_size=batch_size, num_processes=acc.num_processes)
    with memory_cap(cap_bytes) if cap_bytes else contextlib.nullcontext():
        x = torch.randn(batch_size, 3, image_size, image_size, device=acc.device)
        y = torch.randint(0, 10, (batch_size,), device=acc.device)
        loss = F.cross_entropy(net(x), y)
        acc.backward(loss)
        opt.step()
    return float(loss)


def tensor_images(n: int, image_size: int, num_classes: int = 10):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.rand(n, 3, image_size, image_size, generator=g),
                                          torch.randint(0, num_classes, (n,), generator=g))


def _jpeg_sample(args: tuple[int, int, int]) -> dict:
    """Synthetic image i as a JPEG, its width stretched to one of three aspect ratios."""
    import io

    from PIL import Image

    from gpu_lab.data.synthetic import render

    i, size, num_classes = args
    label = i % num_classes
    img = Image.fromarray(render(i, label, size, seed=0))
    width = (size * 3 // 4, size, size * 4 // 3)[i % 3]
    if width != size:
        img = img.resize((width, size))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return {"__key__": f"{i:08d}", "jpg": buf.getvalue(), "cls": label}


def make_jpeg_shards(out: Path, n: int, size: int, processes: int, per_shard: int) -> dict:
    """n synthetic JPEGs (size px high, 3:4 to 4:3) written as shards by `processes` processes."""
    import multiprocessing as mp

    from gpu_lab.data import write_shards

    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(processes) as pool:
        samples = pool.map(_jpeg_sample, [(i, size, 10) for i in range(n)], chunksize=32)
    rep = write_shards(samples, out, maxcount=per_shard, shuffle=False, progress=False)
    nbytes = sum(len(s["jpg"]) for s in samples)
    return {"images": n, "height_px": size, "mean_jpeg_kib": round(nbytes / n / 1024, 1),
            "shards": len(rep.manifest.shards), "seconds": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------------------- steps

IMPORTS = ("torch", "torchvision", "torchvision.io", "accelerate", "pynvml", "psutil",
           "prometheus_client", "safetensors", "tensorboard", "webdataset", "plotly",
           "ipywidgets", "anywidget", "zmq", "zstandard", "braceexpand", "ipykernel",
           "jupyter_client", "nbclient", "nbformat")
# the server extension's handlers need jupyter_server, which does not travel: the telemetry
# step builds the Prometheus exposition without a server
NOT_IMPORTED = ("gpu_lab.server.handlers",)


def step_imports(ctx: Ctx) -> None:
    import importlib
    import pkgutil

    import gpu_lab

    failed = {}
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported, not the first
            failed[name] = f"{type(e).__name__}: {e}"
    mods = [m.name for m in pkgutil.walk_packages(gpu_lab.__path__, "gpu_lab.")
            if m.name not in NOT_IMPORTED]
    for name in mods:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {e}"
    versions = {}
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("torch", "torchvision", "accelerate", "nvidia-ml-py", "webdataset", "plotly",
                 "ipywidgets", "pyzmq", "ipykernel", "jupyter_client", "nbclient"):
        with contextlib.suppress(PackageNotFoundError):
            versions[dist] = version(dist)
    ctx.record(python=sys.version.split()[0], versions=versions, gpu_lab_modules=len(mods),
               failed=failed)
    ctx.check("every module imports", not failed, failed or f"{len(IMPORTS)} packages, "
              f"{len(mods)} gpu_lab modules")
    # the batch decoder's call, here on the CPU (the loader step makes it on the GPU)
    import io

    import torch
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    blobs = []
    for w in (5, 9):
        buf = io.BytesIO()
        Image.new("RGB", (w, 4), (200, 10, 10)).save(buf, format="JPEG")
        blobs.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    shapes = [tuple(t.shape) for t in decode_jpeg(blobs, mode=ImageReadMode.RGB)]
    ctx.check("torchvision.io.decode_jpeg decodes a list", shapes == [(3, 4, 5), (3, 4, 9)], shapes)
    ctx.summary(f"torch {versions.get('torch')}, torchvision {versions.get('torchvision')}, "
                f"{len(mods)} gpu_lab modules, {len(failed)} failed")


def step_environment(ctx: Ctx) -> None:
    from gpu_lab.diagnostics import doctor
    from gpu_lab.telemetry import GPU_FIELDS, NVMLSampler

    rep = doctor()
    ctx.record(doctor=rep.to_dict())  # its host part names /dev/shm, which the loader needs
    print(rep, flush=True)
    sampler = NVMLSampler()
    try:
        gpus = sampler.sample()
        reason = sampler.reason
    finally:
        sampler.close()
    ctx.check("GPU_FIELDS lists 20+ metrics", len(GPU_FIELDS) >= 20, len(GPU_FIELDS))
    if ctx.dry:
        ctx.check("without a GPU, NVML is reported unavailable, not raised", gpus == [] and
                  str(reason).startswith("NVML unavailable:"), reason)
        ctx.summary(f"doctor ran; NVML: {reason}")
        return
    ctx.check("NVML sees a GPU", len(gpus) >= 1, reason)
    g = gpus[0]
    fields, wrong = {}, {}
    for name, (typ, unit, _) in GPU_FIELDS.items():
        v = g.get(name)
        fields[name] = {"value": v, "type": type(v).__name__, "unit": unit}
        ok = v is None or isinstance(v, typ) or (typ is float and isinstance(v, int)
                                                 and not isinstance(v, bool))
        if not ok:
            wrong[name] = f"{type(v).__name__}, expected {typ.__name__}"
    populated = [k for k, f in fields.items() if f["value"] is not None]
    ctx.record(gpu=g.get("name"), nvml_fields=fields, populated=len(populated),
               unpopulated=sorted(set(fields) - set(populated)), wrong_types=wrong)
    ctx.check("20+ NVML fields read for real", len(populated) >= 20,
              f"{len(populated)} of {len(GPU_FIELDS)}")
    ctx.check("every field has its declared type", not wrong, wrong or "all")
    ctx.summary(f"{g.get('name')}: {len(populated)} of {len(GPU_FIELDS)} NVML fields populated, "
                f"{len(wrong)} mistyped")


FORK_CELLS = [
    """
import json, sys, gpu_lab, torch
from gpu_lab.launch import PreflightError, preflight

def refusal(fn):
    try:
        fn()
    except PreflightError as e:
        return str(e)
    return None

out = {"fresh": refusal(lambda: preflight(device="cuda"))}
""",
    """
out["is_available"] = torch.cuda.is_available()
out["after_is_available"] = refusal(lambda: preflight(device="cuda"))
""",
]
FORK_GPU = """
x = torch.zeros(1, device="cuda")
out["after_tensor"] = refusal(lambda: preflight(device="cuda"))
out["launch"] = refusal(lambda: gpu_lab.launch(len, [1], num_processes=1))
print(json.dumps(out))
"""
FORK_DRY = """
from gpu_lab.launch.testing import fake_cuda_state  # no CUDA here: a stand-in for its state
with fake_cuda_state(initialized=True):
    out["after_tensor"] = refusal(lambda: preflight(device="cuda"))
    out["launch"] = refusal(lambda: gpu_lab.launch(len, [1], num_processes=1))
print(json.dumps(out))
"""


def step_fork_safety(ctx: Ctx) -> None:
    out = last_json(run_cells(ctx, FORK_CELLS + [FORK_DRY if ctx.dry else FORK_GPU], 180)[-1])
    ctx.record(**out)
    ctx.check("a fresh kernel passes preflight", out["fresh"] is None, out["fresh"])
    if not ctx.dry:
        ctx.check("torch.cuda.is_available() in the kernel", out["is_available"] is True,
                  out["is_available"])
        ctx.check("refused after torch.cuda.is_available() (bad-fork state)",
                  out["after_is_available"] is not None and "bad-fork" in out["after_is_available"],
                  out["after_is_available"])
    what = "(CUDA state stood in for) " if ctx.dry else ""
    ctx.check(f"refused {what}after a CUDA tensor: CUDA initialised",
              out["after_tensor"] is not None and "already initialised" in out["after_tensor"],
              out["after_tensor"])
    ctx.check(f"launch refuses too {what}", out["launch"] is not None, out["launch"])
    ctx.summary("preflight passes fresh, refuses after is_available() and after a CUDA tensor"
                if not ctx.dry else "real kernel; refusal with a stand-in CUDA state")


def step_precision(ctx: Ctx) -> None:
    import torch

    from gpu_lab.models import build
    from gpu_lab.train import fit
    from gpu_lab.train.guards import MemoryGuard

    if ctx.dry:
        from gpu_lab.train.validate import ConfigError, validate

        try:
            validate(train_config(ctx, mixed_precision="fp16", max_steps=2), gpu_count=0)
            refused = None
        except ConfigError as e:
            refused = str(e)
        ctx.check("fp16 refused without a GPU (loss scaling needs CUDA)",
                  refused is not None and "fp16" in refused, refused)
    else:
        # fp16 + GradScaler through fit(), the scaler's state through a resume, the real memory
        # probe and activation checkpointing's peak: the GPU test's script, in its own process
        r = last_json(python("tests/train_gpu_script.py", str(ctx.work / "fp16")))
        peaks = r["resnet18_peak_bytes"]
        ctx.record(fp16=r)
        ctx.check("fp16 autocast: the head computes in float16",
                  r["head_dtypes"] == ["torch.float16"], r["head_dtypes"])
        ctx.check("GradScaler's state saved with the checkpoint",
                  r["scaler_state"].get("scale", 0) > 0, r["scaler_state"])
        ctx.check("fp16 run resumed from step 20 to 30", str(r["second"]["resumed_from"])
                  .endswith("step_000000020") and r["second"]["steps"] == 30, r["second"])
        ctx.check("real memory probe in (0, 1)", 0 < r["memory_fraction"] < 1, r["memory_fraction"])
        ctx.check("activation checkpointing lowers the peak",
                  peaks["checkpointed"] < peaks["plain"], peaks)
    device = "cpu" if ctx.dry else "cuda"
    data = tensor_images(256, 32)
    dtypes: list[str] = []
    # the dry run checks the bf16 path, not its speed: a CPU without bf16 units emulates it at
    # tens of times the fp32 cost, so two small steps
    size, batch, steps = (16, 8, 2) if ctx.dry else (32, 64, 20)
    model = build("tiny_resnet", 10, size)
    model.fc.register_forward_hook(lambda m, i, o: dtypes.append(str(o.dtype)))
    s = fit(model, tensor_images(batch * steps, size) if ctx.dry else data,
            train_config(ctx, model="tiny_resnet", image_size=size, batch_size=batch,
                         max_steps=steps, mixed_precision="bf16", num_workers=0,
                         output_dir=str(ctx.work / "bf16")))
    ctx.record(bf16={k: s[k] for k in ("steps", "loss", "samples_per_s", "mixed_precision")})
    ctx.check(f"bf16 trains on {device}", math.isfinite(s["loss"]) and "torch.bfloat16" in dtypes
              and next(model.parameters()).device.type == device, (s["loss"], sorted(set(dtypes))))

    # the 95% snapshot: memory really filled to past the threshold on the GPU
    out = ctx.work / "snapshot"
    callbacks: list = []
    filler = None
    guards = not ctx.dry
    if ctx.dry:
        callbacks = [MemoryGuard(0.95, probe=lambda: 0.97)]  # no device memory: a stand-in probe
    else:
        free, total = torch.cuda.mem_get_info()
        filler = torch.empty(max(0, int(free - 0.035 * total)), dtype=torch.uint8, device="cuda")
        ctx.record(filled_fraction=1 - torch.cuda.mem_get_info()[0] / total)
    try:
        fit(build("tiny_resnet", 10, 32), data,
            train_config(ctx, model="tiny_resnet", image_size=32, batch_size=64, max_steps=3,
                         num_workers=0, memory_threshold=0.95, output_dir=str(out)),
            callbacks=callbacks, guards=guards)
    finally:
        del filler
        if not ctx.dry:
            torch.cuda.empty_cache()
    snaps = sorted((out / "memory").glob("*.json"))
    info = json.loads(snaps[0].read_text()) if snaps else {}
    ctx.record(snapshot={k: info.get(k) for k in ("step", "fraction", "threshold",
                                                   "allocator_snapshot")},
               snapshot_files=[p.name for p in (out / "memory").glob("*")] if snaps else [])
    ctx.check("memory ≥ 95% wrote one snapshot", len(snaps) == 1 and (info.get("fraction") or 0)
              >= 0.95, info.get("fraction"))
    if not ctx.dry:
        ctx.check("the allocator snapshot (memory_viz) was dumped",
                  bool(info.get("allocator_snapshot"))
                  and Path(info["allocator_snapshot"]).exists(),
                  info.get("allocator_snapshot"))
        peaks = ctx.results["fp16"]["resnet18_peak_bytes"]
        ctx.summary(f"fp16+GradScaler resume ok; bf16 ok; activation checkpointing peak "
                    f"{peaks['checkpointed'] / peaks['plain']:.2f}x of plain; snapshot at "
                    f"{info.get('fraction', 0):.1%}")
    else:
        ctx.summary("bf16 on CPU; fp16 refused; snapshot with a stand-in probe")


def step_oom(ctx: Ctx) -> None:
    import gpu_lab
    from gpu_lab.failures import triage

    # a real out-of-memory error in a launched rank, and its triage (before any CUDA call here)
    if ctx.dry:  # tiny_resnet at 64 px under a 256 MiB cap
        batch, args = 512, ("tiny_resnet", 64, 256 * 1024 ** 2)
    else:
        batch, args = 4096, ("resnet50", 224, None)
    run = gpu_lab.launch(train_one_step, batch, *args, num_processes=1, name="gpu-check-oom")
    status = run.wait(240)
    ctx.check("the run failed", status == "failed", status)
    f = run.error.first if run.error else None
    if f is None:
        raise RuntimeError(f"run {run.id} {status} without a triage; logs:\n{run.logs(0, 40)}")
    d = f.details
    ctx.record(triage={"category": f.category, "details": d, "explanation": f.explanation,
                       "suggestions": f.suggestions[:4]})
    print(run.error, flush=True)
    ctx.check("categorised as out of memory", f.category == triage.OOM, f.category)
    ctx.check("the real numbers: requested, free, total", all(isinstance(d.get(k), int) for k in
              ("requested_bytes", "free_bytes", "total_bytes")) and d["requested_bytes"] > 0, d)
    ctx.check("the batch size found", d.get("batch_size") == batch, d.get("batch_size"))
    if not ctx.dry:
        import pynvml

        pynvml.nvmlInit()
        try:
            total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
        finally:
            pynvml.nvmlShutdown()
        ctx.check("total is the device's memory (within 3%)",
                  abs(d.get("total_bytes", 0) - total) <= 0.03 * total,
                  (d.get("total_bytes"), total))

    # the auto-retry in fit(): half the batch, twice the accumulation, the same global batch
    import torch

    from gpu_lab.models import build
    from gpu_lab.train import fit

    if ctx.dry:
        class OverBudget(torch.nn.Module):
            """tiny_cnn whose forward asks the CPU allocator for 1 PiB above 4 images: a real
            allocator out-of-memory error on a CPU (the GPU run uses ResNet-50's activations)."""

            def __init__(self) -> None:
                super().__init__()
                self.net = build("tiny_cnn", 10, 32)

            def forward(self, x):
                if x.shape[0] > 4:
                    torch.empty(1 << 50, dtype=torch.uint8)
                return self.net(x)

        model, data, batch = OverBudget(), tensor_images(64, 32), 16
        cfg = train_config(ctx, model="tiny_cnn", image_size=32, batch_size=batch, max_steps=2,
                           num_workers=0, oom_retry=True)
    else:
        model, data, batch = build("resnet50", 10, 224), tensor_images(2048, 224), 2048
        cfg = train_config(ctx, model="resnet50", image_size=224, batch_size=batch, max_steps=1,
                           num_workers=0, oom_retry=True)
    s = fit(model, data, cfg)
    keep = ("steps", "micro_batch_size", "grad_accum_steps", "global_batch", "oom_retries", "loss")
    ctx.record(retry={k: s[k] for k in keep})
    ctx.check("retried after a real out-of-memory error", s["oom_retries"] >= 1, s["oom_retries"])
    ctx.check("the global batch is kept", s["global_batch"] == batch and s["micro_batch_size"]
              * s["grad_accum_steps"] == batch, {k: s[k] for k in keep[1:4]})
    ctx.summary(f"{re.split(r'[.:] ', f.explanation)[0]}; retry: {s['micro_batch_size']} x "
                f"{s['grad_accum_steps']} = {s['global_batch']} after {s['oom_retries']} OOM(s)")


def _gpu_train(ctx: Ctx, variants: str) -> None:
    args = ["bench/gpu_train.py", "--json", "--variants", variants]
    if ctx.dry:
        args += ["--cpu", "--steps", "1", "--warmup", "0"]
    res = last_json(python(*args))
    rows = res["rows"]
    ctx.record(gpu=res["gpu_name"], model=res["model"], image_size=res["image_size"],
               batch_size=res["batch_size"], flops_per_image=res["flops_per_image"],
               peak_tflops=res["peak_tflops"], rows=rows, notes=res["notes"])
    ctx.check("every variant ran", [r["variant"] for r in rows] == variants.split(",")
              and all(r["images_per_s"] > 0 for r in rows), [r["variant"] for r in rows])
    if not ctx.dry:
        ctx.check("on the GPU", res["device"] == "cuda", res["device"])
        ctx.check("MFU known for this GPU", all(r["mfu"] is not None for r in rows),
                  res["peak_tflops"])
    ctx.summary(", ".join(f"{r['variant']} {r['images_per_s']:,.0f} img/s"
                          + (f" (MFU {r['mfu']:.0%})" if r["mfu"] else "") for r in rows))


def step_gpu_train(ctx: Ctx) -> None:
    _gpu_train(ctx, "fp32" if ctx.dry else "fp32,tf32,bf16")


def _compile(ctx: Ctx, variant: str) -> None:
    if ctx.dry:
        # compiling on this CPU would take minutes: check that the pieces are there
        import torch._dynamo  # noqa: F401
        import torch._inductor.config  # noqa: F401

        python("bench/gpu_train.py", "--help")
        ctx.check("inductor imports; bench/gpu_train.py answers", True, variant)
        ctx.summary(f"{variant}: inductor imports (not compiled on the CPU)")
        return
    _gpu_train(ctx, variant)


def step_compile_bf16(ctx: Ctx) -> None:
    _compile(ctx, "bf16+compile")


def step_compile_tf32(ctx: Ctx) -> None:
    _compile(ctx, "tf32+compile")


# The tolerance between nvJPEG and libjpeg-turbo decodes, in 0-255 levels averaged over a batch:
# the two IDCTs and chroma upsamplers differ, and CUDA resizes uint8 through float and rounds.
# A different crop or flip of the same images differs by tens of levels on average.
DECODE_TOLERANCE = 2.0


def _loader_throughput(shards: Path, decode: str, batch: int, crop: int, workers: int,
                       device: str | None) -> dict:
    """img/s of the loader alone over its second epoch (the first starts the workers)."""
    import torch

    from gpu_lab.data import shard_loader

    loader = shard_loader(shards, batch, train=True, image_size=crop, num_workers=workers,
                          decode=decode, device=device, rank=0, world_size=1, seed=1)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in loader:
        pass
    sync()
    t0, n = time.perf_counter(), 0
    for x, _ in loader:
        n += x.shape[0]
    sync()
    dt = time.perf_counter() - t0
    return {"decode": decode, "workers": workers, "images": n, "seconds": round(dt, 3),
            "images_per_s": round(n / dt, 1)}


def _decode_difference(shards: Path, crop: int, device: str, batches: int) -> dict:
    """The same batches (same keys, same draws) decoded on the CPU and by the batch decoder."""
    import torch

    from gpu_lab.data import shard_loader

    kw = dict(train=True, image_size=crop, num_workers=2, rank=0, world_size=1, seed=7,
              return_keys=True, output="uint8")
    got: dict[str, dict] = {"cpu": {}, "gpu": {}}
    for decode in got:
        torch.manual_seed(0)
        loader = shard_loader(shards, 32, decode=decode, device=device if decode == "gpu" else None,
                              **kw)
        for i, (x, _, keys) in enumerate(loader):
            got[decode].update(zip(keys, x.cpu()))
            if i + 1 == batches:
                break
    keys = sorted(got["cpu"])
    same_keys = keys == sorted(got["gpu"])
    diffs = [(got["cpu"][k].float() - got["gpu"][k].float()).abs() for k in keys if k in got["gpu"]]
    flipped = [(got["cpu"][k].float() - got["cpu"][k].flip(-1).float()).abs().mean() for k in keys]
    return {"images": len(keys), "same_keys": same_keys,
            "mean_abs_diff": float(torch.stack([d.mean() for d in diffs]).mean()),
            "max_abs_diff": float(max(d.max() for d in diffs)),
            "share_over_8_levels": float(torch.cat([(d > 8).flatten() for d in diffs])
                                         .float().mean()),
            "mean_abs_diff_of_a_flip": float(torch.stack(flipped).mean())}


def step_loader(ctx: Ctx) -> None:
    from gpu_lab.data import gpu_decode
    from gpu_lab.diagnostics import find_bottleneck

    import gpu_lab

    if ctx.dry:
        n, size, crop, batch, workers, steps = 96, 48, 32, 16, 1, 6
    else:
        n, size, crop, batch, workers, steps = 8192, 384, 224, 256, max(1, ctx.cores - 1), 30
    root = ctx.work / "data"
    shards = root / "train"
    ctx.record(data=make_jpeg_shards(shards, n, size, max(1, ctx.cores), per_shard=max(8, n // 64)))

    # 1. the training step's data-wait share: train_classifier on the shards, launched as users do
    # (this process stays CUDA-free until the launches are done)
    decodes = ("auto",) if ctx.dry else ("cpu", "gpu")
    training = {}
    for decode in decodes:
        cfg = train_config(
            ctx, model="tiny_cnn" if ctx.dry else "resnet50", image_size=crop, num_classes=10,
            batch_size=batch, max_steps=steps, mixed_precision="no" if ctx.dry else "bf16",
            channels_last=not ctx.dry, num_workers=workers, decode=decode, data_dir=str(root),
            output_dir=str(ctx.work / "runs" / decode))
        run = gpu_lab.launch(train_and_tell, cfg, name=f"gpu-check-loader-{decode}")
        res = run.result(timeout=300)
        b = find_bottleneck(run, skip=1 if ctx.dry else 5)
        training[decode] = {"samples_per_s": round(b.samples_per_s or 0, 1),
                            "data_wait_share": round(b.fractions()["data"], 4),
                            "step_ms": round(b.step_time * 1e3, 2), "bound": b.bound,
                            "steps": res["steps"], "cuda_device": res["cuda_device"]}
        ctx.check(f"decode={decode}: trained {steps} steps on the shards", res["steps"] == steps,
                  training[decode])
    ctx.record(training=training)

    # 2. the loader alone, and the batch decoder's output against the CPU path's
    if ctx.dry:
        try:
            from gpu_lab.data import shard_loader

            shard_loader(shards, batch, decode="gpu", rank=0, world_size=1)
            refused = None
        except ValueError as e:
            refused = str(e)
        ctx.check("decode='gpu' refused on a CPU host", refused is not None and "no GPU" in refused,
                  refused)
        alone = {"cpu": _loader_throughput(shards, "cpu", batch, crop, workers, None)}
        # no GPU: the batch decoder runs on CPU tensors, with a stand-in for NVML's "there is one"
        from unittest import mock

        with mock.patch.object(gpu_decode, "gpu_present", lambda: True):
            diff = _decode_difference(shards, crop, "cpu", batches=2)
        ctx.check("on the CPU the batch decoder equals the CPU path bit for bit",
                  diff["same_keys"] and diff["max_abs_diff"] == 0, diff)
    else:
        alone = {d: _loader_throughput(shards, d, batch, crop, workers, "cuda")
                 for d in ("cpu", "gpu")}
        diff = _decode_difference(shards, crop, "cuda", batches=4)
        ctx.check("the same images and draws on both paths", diff["same_keys"], diff)
        ctx.check(f"GPU decode within {DECODE_TOLERANCE} levels of the CPU path on average",
                  diff["mean_abs_diff"] <= DECODE_TOLERANCE
                  and diff["mean_abs_diff"] < diff["mean_abs_diff_of_a_flip"] / 4, diff)
    ctx.record(loader_alone=alone, decode_difference=diff)
    parts = [f"{d}-decode {a['images_per_s']:,.0f} img/s alone" for d, a in alone.items()]
    parts += [f"{d}: training {t['samples_per_s']:,.0f} img/s, data wait {t['data_wait_share']:.0%}"
              for d, t in training.items()]
    ctx.summary("; ".join(parts) + f"; decode |diff| {diff['mean_abs_diff']:.2f} levels")


LAUNCH_CELLS = [
    """
import json, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import gpu_lab, gpu_check_steps as S
cfg = gpu_lab.TrainConfig(**{cfg!r})
run = gpu_lab.launch(S.train_and_tell, cfg, name="gpu-check-launch")
returned_at_once = not run.done
""",
    """
reached = run.wait_for_step({stop_at}, timeout=240)
seen = run.metrics.count("loss", 0)
status = run.stop()
saved = sorted(p.name for p in (Path(run.output_dir) / "checkpoints").glob("step_*"))
""",
    """
k = int(saved[-1].split("_")[1])
cfg2 = cfg.replace(max_steps=k + {more})
run2 = gpu_lab.launch(S.train_and_tell, cfg2, resume=run, name="gpu-check-resume")
res = run2.result(timeout=240)
torch = sys.modules.get("torch")
print(json.dumps(dict(returned_at_once=returned_at_once, reached=reached, metrics_seen=seen,
                      status=status, saved=saved, k=k, resumed=res,
                      kernel_cuda=bool(torch and torch.cuda.is_initialized()))))
""",
]


def step_launch(ctx: Ctx) -> None:
    if ctx.dry:
        kw = dict(model="tiny_cnn", image_size=32, batch_size=16, num_workers=0,
                  mixed_precision="no")
        stop_at, more = 3, 3
    else:
        kw = dict(model="resnet18", image_size=64, batch_size=128, num_workers=4,
                  mixed_precision="bf16")
        stop_at, more = 10, 10
    cfg = dict(max_steps=100_000, epochs=None, num_processes=1, tensorboard=False, log_every=1,
               eval_every=10**9, checkpoint_every=0, output_dir=str(ctx.work / "out"), **kw)
    cells = [c.format(bench=str(BENCH), cfg=cfg, stop_at=stop_at, more=more) for c in LAUNCH_CELLS]
    out = last_json(run_cells(ctx, cells, 300)[-1])
    res = out["resumed"]
    ctx.record(**{k: v for k, v in out.items() if k != "resumed"},
               resumed={k: res.get(k) for k in ("steps", "resumed_from", "loss", "samples_per_s",
                                                "num_processes", "cuda_device", "bad_fork")})
    ctx.check("launch returned at once", out["returned_at_once"], "")
    ctx.check("metrics reached the kernel", out["reached"] and out["metrics_seen"] >= stop_at,
              out["metrics_seen"])
    # A one-rank run trains inside the supervisor; a stop request that its loop sees before the
    # SIGTERM ends it normally, and the supervisor then records "succeeded", not "stopped"
    # (gpu_lab.supervise.supervisor): recorded here, not failed on; the run must end at a checkpoint.
    ctx.check("stop ended the run at a checkpoint", out["status"] in ("stopped", "succeeded")
              and out["saved"] and out["k"] < cfg["max_steps"], (out["status"], out["saved"]))
    if out["status"] != "stopped":
        ctx.record(stop_status_note=f"Run.stop() left the status {out['status']!r}, not 'stopped'")
    ctx.check("resume continued from that checkpoint", str(res["resumed_from"]).endswith(
        out["saved"][-1]) and res["steps"] == out["k"] + more, (res["resumed_from"], res["steps"]))
    ctx.check("one rank", res["num_processes"] == 1, res["num_processes"])
    ctx.check("the rank was not a bad fork", res["bad_fork"] is False, res["bad_fork"])
    ctx.check("the kernel stayed CUDA-free", out["kernel_cuda"] is False, out["kernel_cuda"])
    if not ctx.dry:
        ctx.check("the rank trained on the GPU", bool(res["cuda_device"]), res["cuda_device"])
    ctx.summary(f"1 rank on {res['cuda_device'] or 'cpu'}: {out['metrics_seen']} reports in the "
                f"kernel, stopped at {out['saved'][-1]}, resumed to step {res['steps']}")


def step_fsdp(ctx: Ctx) -> None:
    """fit(sharding="fsdp") on every GPU (on one GPU: with offload, which still applies), a
    checkpoint of the whole model, and a resume; in the dry run, two CPU ranks."""
    import gpu_lab
    from gpu_lab.telemetry.probe import gpu_count
    from gpu_lab.train import train_classifier

    ranks = 2 if ctx.dry else max(1, gpu_count())
    kw = dict(model="tiny_resnet", image_size=32, batch_size=32, max_steps=6, optimizer="adamw",
              checkpoint_every=3, num_workers=0,
              mixed_precision="no" if ctx.dry else "bf16")
    results = {}
    for sharding in ("none", "fsdp"):
        cfg = train_config(ctx, sharding=sharding, num_processes=ranks,
                           offload=sharding == "fsdp" and ranks == 1 and not ctx.dry, **kw)
        run = gpu_lab.launch(train_classifier, cfg, name=f"gpu-check-{sharding}")
        ctx.check(f"{sharding}: succeeded", run.wait(timeout=240) == "succeeded", run.error)
        results[sharding] = (run, run.result())
    run, fsdp = results["fsdp"]
    plain = results["none"][1]
    share = fsdp["rank_param_bytes"] / plain["rank_param_bytes"]
    ctx.record(ranks=ranks, param_share=round(share, 3), sharding=fsdp["sharding"],
               rank_param_bytes=[plain["rank_param_bytes"], fsdp["rank_param_bytes"]])
    if ranks > 1:
        ctx.check("each rank holds about 1/N of the parameters", abs(share - 1 / ranks) < 0.05,
                  share)
    more = run.resume(max_steps=9)
    ctx.check("resumed from the sharded run's checkpoint", more.wait(timeout=240) == "succeeded"
              and more.result()["steps"] == 9, more.error)
    ctx.summary(f"{ranks} rank(s): rank 0 holds {share:.0%} of the parameters; resumed to 9")


def _prometheus(ctx: Ctx) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from gpu_lab.server.metrics import exposition
    from gpu_lab.server.state import ServerState

    state = ServerState(root_dir=str(ctx.work))
    try:
        text = exposition(state).decode()
    finally:
        state.executor.shutdown(wait=False)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {name: [(s.labels, s.value) for s in fam.samples] for name, fam in fams.items()}


def step_telemetry(ctx: Ctx) -> None:
    sys.path.insert(0, str(BENCH))
    import dashboard_overhead

    import gpu_lab
    from gpu_lab.server.metrics import GPU_GAUGES
    from gpu_lab.train import train_classifier

    if ctx.dry:
        cfg = train_config(ctx, model="tiny_cnn", image_size=32, batch_size=16, num_workers=0,
                           max_steps=10**7)
        n_windows, window_s = 2, 1.5  # the path, not the figure: the GPU run measures it
    else:
        cfg = train_config(ctx, model="resnet50", image_size=224, batch_size=64,
                           mixed_precision="bf16", channels_last=True, max_steps=10**7,
                           num_workers=max(1, min(12, ctx.cores - 2)))
        n_windows, window_s = 8, 3.0
    run = gpu_lab.launch(train_classifier, cfg, name="gpu-check-telemetry")
    try:
        if not run.wait_for_step(5, timeout=240):
            raise RuntimeError(f"run {run.id} {run.status}: {run.error}\n{run.logs(0, 30)}")
        # A window must hold several reports, at whatever pace this machine trains right now
        rate = dashboard_overhead.step_rate(run)
        window_s = max(window_s, 10 / rate if rate > 0 else 10.0)
        series = _prometheus(ctx)
        w = dashboard_overhead.attach_detach_windows(run, cfg.batch_size, n_windows, window_s)
    finally:
        status = run.stop()
    gpus = series.get("gpu_lab_gpus", [({}, None)])[0][1]
    mem = [v for _, v in series.get("gpu_lab_gpu_memory_used_bytes", [])]
    util = [v for _, v in series.get("gpu_lab_gpu_utilization_percent", [])]
    power = [v for _, v in series.get("gpu_lab_gpu_power_watts", [])]
    gpu_series = sorted(n for n in series if n.startswith("gpu_lab_gpu_") and series[n])
    ratio = sorted(w["ratios"])[len(w["ratios"]) // 2]
    ctx.record(prometheus_gpu_series=gpu_series, gpus=gpus, memory_used_bytes=mem,
               utilization_percent=util, power_watts=power,
               host_series=sorted(n for n in series if n.startswith("gpu_lab_host_")),
               dashboard={**w, "median_ratio": ratio, "target": dashboard_overhead.TARGET},
               run_status=status)
    ctx.check("a run's series in the exposition", any(v == 1.0 for _, v in
                                                       series.get("gpu_lab_run_info", [])), "")
    if ctx.dry:
        ctx.check("no GPU: gpu_lab_gpus 0, host series present", gpus == 0 and
                  "gpu_lab_host_cpu_percent" in series, gpus)
    else:
        ctx.check("one GPU in gpu_lab_gpus", gpus == 1, gpus)
        ctx.check("every GPU gauge has a sample", len(gpu_series) >= len(GPU_GAUGES), gpu_series)
        ctx.check("memory in use while training (> 1 GiB)", mem and mem[0] > GiB, mem)
    ctx.check("throughput measured with the dashboard attached and detached",
              len(w["ratios"]) == n_windows // 2 and all(r > 0 for r in w["ratios"]), w["ratios"])
    ctx.summary(f"{len(gpu_series)} GPU series (util {util[0] if util else '-'}%, "
                f"{(mem[0] / GiB) if mem else 0:.1f} GiB used); dashboard attached/detached "
                f"{ratio:.3f} (median of {len(w['ratios'])} window pairs; bench target "
                f">= {dashboard_overhead.TARGET})")


def step_nccl(ctx: Ctx) -> None:
    import torch
    import torch.distributed as dist

    backend, device = ("gloo", "cpu") if ctx.dry else ("nccl", "cuda")
    store = dist.FileStore(str(ctx.work / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        rows = []
        for mib in ((1, 16) if ctx.dry else (1, 64, 1024)):
            x = torch.ones(mib * 2**20 // 4, device=device)
            dist.all_reduce(x)  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            iters = 10
            for _ in range(iters):
                dist.all_reduce(x)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / iters
            rows.append({"mib": mib, "ms": round(dt * 1e3, 3), "correct": bool(x[0].item() == 1.0)})
        version = torch.cuda.nccl.version() if device == "cuda" else None
    finally:
        dist.destroy_process_group()
    ctx.record(backend=backend, nccl_version=version, rows=rows,
               note="one GPU: a one-rank group (NCCL refuses two ranks on one device), so this "
                    "checks that NCCL initialises and reduces, not a bandwidth between GPUs")
    ctx.check(f"{backend} all-reduce on one rank", all(r["correct"] for r in rows), rows)
    ctx.summary(f"{backend} {version or ''}: one-rank all-reduce of "
                f"{', '.join(str(r['mib']) + ' MiB' for r in rows)} ok")


STEPS: list[Step] = [
    Step("imports", "every module and the carried packages import", 60, step_imports,
         "the same"),
    Step("environment", "doctor's report; NVML's 20+ fields, read for real, with their types", 60,
         step_environment, "doctor; NVML reported unavailable"),
    Step("fork_safety", "preflight refuses in a real kernel after a CUDA call", 90,
         step_fork_safety, "a real kernel; the CUDA state stood in for"),
    Step("precision", "fp16 + GradScaler and resume, bf16, activation checkpointing's peak, "
         "the 95% memory snapshot with real device memory", 150, step_precision,
         "bf16 on the CPU, fp16 refused, the snapshot with a stand-in probe"),
    Step("oom", "a real CUDA OOM and its triage; the auto-retry keeps the global batch", 150,
         step_oom, "a real CPU allocator OOM under a cap; the retry"),
    Step("gpu_train", "bench/gpu_train.py: ResNet-50 at 224 px, fp32 / TF32 / bf16, "
         "channels_last: img/s, MFU, NVIDIA's A100 figures", 150, step_gpu_train,
         "the CPU mode, one step"),
    Step("loader", "img/s through the shard loader with CPU and GPU decode, the training "
         "step's data-wait share for each, GPU decode against CPU decode", 180, step_loader,
         "a small set: CPU decode, the refusal, the batch decoder on CPU tensors"),
    Step("launch", "from a real kernel: a 1-rank CUDA run, metrics in the kernel, stop, resume",
         150, step_launch, "the same with a 1-rank CPU run"),
    Step("telemetry", "the Prometheus GPU series and the dashboard's overhead during a GPU run",
         150, step_telemetry, "the same during a CPU run"),
    Step("nccl", "NCCL initialises and all-reduces (one GPU: one rank)", 60, step_nccl,
         "the same with gloo"),
    Step("fsdp", "fit(sharding='fsdp') on every GPU (one GPU: with offload), checkpoint, resume",
         90, step_fsdp, "the same on two CPU ranks"),
    Step("compile_bf16", "bench/gpu_train.py with torch.compile, bf16", 240, step_compile_bf16,
         "inductor imports"),
    Step("compile_tf32", "bench/gpu_train.py with torch.compile, TF32", 240, step_compile_tf32,
         "inductor imports"),
]
