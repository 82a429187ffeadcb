"""How long training work takes on GPUs, before running it: what a tutorial's full mode states
in its first cell, for one GPU and for eight.

The throughput comes from this machine's GPU check where it has run (`bench/gpu_check.py` leaves
`gpu_check.json` in GPU_LAB_HOME: ResNet-50 at 224 px in bf16, measured here), otherwise from
NVIDIA's published ResNet-50 figure for an A100 80GB (2,470 img/s in mixed precision), and is
labelled an estimate. Other models scale by their FLOPs per image, counted on the meta device;
a step never takes less than a small model's kernel launches allow (MIN_STEP_S), and every run
pays a start (processes, CUDA, cuDNN's autotuning: RUN_START_S).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

#: NVIDIA's ResNet-50 training figure on an A100 80GB, mixed precision (the one bench/gpu_train.py
#: compares with): the reference where this machine has measured nothing
REFERENCE_IMG_S, REFERENCE_GPU = 2470.0, "an A100 80GB (NVIDIA's published ResNet-50 figure)"
REFERENCE_MODEL, REFERENCE_SIZE = "resnet50", 224
MIN_STEP_S = 0.003    # a small model's step: forward, backward and optimizer kernel launches
RUN_START_S = 15.0    # a launched run's start: ranks, CUDA context, cuDNN autotuning
#: data-parallel efficiency assumed across the GPUs of one server (NVLink, DDP overlapping)
SCALING = 0.9


@dataclass(frozen=True)
class Work:
    """Training work of a notebook's full mode: `steps` optimizer steps of `batch` images each on
    every rank, of `model` at `image_size` px. `ranks`: "all" (one per GPU, the batch per GPU) or
    a fixed count (a 1-rank measurement runs on one GPU whatever the server has); `runs`: how
    many such runs; `parallel`: the runs share the server's GPUs side by side (a sweep's trials),
    instead of one after another."""

    model: str
    image_size: int
    steps: int
    batch: int
    ranks: int | str = "all"
    runs: int = 1
    parallel: bool = False


def _flops_per_image(model: str, image_size: int, cache: dict[tuple[str, int], float]) -> float:
    """Training FLOPs per image: three forward passes' worth (forward + backward), counted on the
    meta device without autograd (a backward here would start threads that spoil later forks)."""
    key = (model, image_size)
    if key not in cache:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from .models import build

        with torch.device("meta"), torch.no_grad():
            net = build(model, num_classes=1000, image_size=image_size).eval()  # BatchNorm of 1
            with FlopCounterMode(display=False) as fc:
                net(torch.randn(1, 3, image_size, image_size))
        cache[key] = 3.0 * fc.get_total_flops()
    return cache[key]


def measured() -> dict | None:
    """This machine's GPU check, if it ran: {"gpu", "images_per_s", "date"} for ResNet-50 at
    224 px in bf16 (GPU_LAB_HOME/gpu_check.json, or the file GPU_LAB_GPU_CHECK names)."""
    path = os.environ.get("GPU_LAB_GPU_CHECK") or ""
    if not path:
        from .record.registry import home

        try:
            path = str(home() / "gpu_check.json")
        except OSError:  # a home that cannot be made holds no check
            return None
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    for step in report.get("steps", []):
        res = step.get("results") or {}
        if step.get("name") != "gpu_train" or res.get("model") != REFERENCE_MODEL:
            continue
        row = next((r for r in res.get("rows", []) if r.get("variant") == "bf16"), None)
        if row and row.get("images_per_s"):
            return {"gpu": res.get("gpu"), "images_per_s": float(row["images_per_s"]),
                    "date": report.get("started", "")[:10]}
    return None


@dataclass(frozen=True)
class Estimate:
    """Seconds of a notebook's full mode on one GPU and on eight, and where the throughput came
    from (`source`); `measured` when this machine's GPU check gave it."""

    one_gpu_s: float
    eight_gpu_s: float
    source: str
    measured: bool

    def __str__(self) -> str:
        kind = "from this machine's GPU check" if self.measured else "an estimate from FLOPs"
        return (f"full mode takes about {_duration(self.one_gpu_s)} on one GPU, "
                f"{_duration(self.eight_gpu_s)} on eight ({kind}: {self.source})")


def _duration(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s / 10) * 10):.0f} s"
    if s < 90 * 60:
        return f"{math.ceil(s / 60):.0f} min"
    return f"{s / 3600:.1f} h"


def full_mode(work: Sequence[Work]) -> Estimate:
    """The time `work` takes on one GPU and on eight (see the module docstring)."""
    ref = measured()
    rate = ref["images_per_s"] if ref else REFERENCE_IMG_S
    source = (f"ResNet-50 at {rate:,.0f} img/s in bf16 on {ref['gpu']}, {ref['date']}" if ref
              else f"ResNet-50 at {rate:,.0f} img/s on {REFERENCE_GPU}; other models by FLOPs")
    cache: dict[tuple[str, int], float] = {}
    ref_flops = _flops_per_image(REFERENCE_MODEL, REFERENCE_SIZE, cache)
    totals = []
    for gpus in (1, 8):
        total = 0.0
        for w in work:
            if w.steps < 0 or w.batch < 1 or w.runs < 1:
                raise ValueError(f"{w}: steps ≥ 0, batch ≥ 1 and runs ≥ 1")
            ranks = gpus if w.ranks == "all" else min(int(w.ranks), gpus)
            per_image = _flops_per_image(w.model, w.image_size, cache) / ref_flops / rate
            step = max(MIN_STEP_S, w.batch * per_image)  # each rank its own batch, side by side
            step /= SCALING if ranks > 1 else 1.0
            waves = math.ceil(w.runs / max(1, gpus // ranks)) if w.parallel else w.runs
            total += waves * (RUN_START_S + w.steps * step)
        totals.append(total)
    return Estimate(totals[0], totals[1], source, ref is not None)


__all__ = ["Work", "Estimate", "full_mode", "measured", "REFERENCE_IMG_S", "MIN_STEP_S",
           "RUN_START_S"]
