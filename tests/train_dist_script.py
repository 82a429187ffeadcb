"""Training scripts for the multi-process tests of gpu_lab.train (run as real processes).

    python tests/train_dist_script.py <mode> <out_dir>                  # under torchrun, or by hand
    python tests/train_dist_script.py notebook <mode>[,<mode>…] <out_dir> <n>
                                         # via notebook_launcher; results in <out_dir>/<mode>

Modes:
  accum      tiny_vit, 4 micro-batches of 4 per rank, SGD, 3 steps (global batch 32 on 2 ranks)
  resume     tiny_cnn (BatchNorm) with dropout before its head (so the global torch RNG matters),
             AdamW + warmup/cosine, clipping, accumulation 2, 12 steps over 3 epochs; resumes from
             out_dir/checkpoints
  hold       as resume, but at HOLD_STEP each rank writes out_dir/reached_rank<r> and waits (polls,
             with a deadline) for the test's SIGTERM; the preemption guard then checkpoints and the
             process exits with 143
  zero       ZeRO-1 + PowerSGD on 2 ranks, a checkpoint mid-way (consolidated optimizer state)

Every mode writes out_dir/rank<r>.safetensors (its final parameters; buffers such as BatchNorm
running statistics are left out: DDP gives every rank rank 0's buffers at each forward, and each
rank then updates its own) and out_dir/summary_rank<r>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from gpu_lab.config import TrainConfig
from gpu_lab.models import build
from gpu_lab.train import Callback, fit
from gpu_lab.train.guards import PreemptionGuard, default_guards

HOLD_STEP = 6


class FixedImages(Dataset):
    """Fixed random images and labels (the same on every rank and in every run)."""

    def __init__(self, n: int = 64, size: int = 16, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class HoldAt(Callback):
    """At `step`, announce it in a file and wait until the preemption guard saw a signal."""

    def __init__(self, step: int, out: Path, guard: PreemptionGuard) -> None:
        self.step, self.out, self.guard = step, out, guard

    def on_step_end(self, state) -> None:
        if state.step != self.step:
            return
        (self.out / f"reached_rank{state.rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while self.guard.received is None and time.monotonic() < deadline:
            time.sleep(0.01)


class Inspect(Callback):
    """Record what fit() built: the optimizer class and the DDP communication hook."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, state, summary) -> None:
        opt = getattr(state.optimizer, "optimizer", state.optimizer)
        ddp = getattr(state.model, "_get_ddp_logging_data", dict)()
        (self.out / f"fit_info_rank{state.rank}.json").write_text(json.dumps(
            {"optimizer": type(opt).__name__, "comm_hook": str(ddp.get("comm_hook", ""))}))


def config(mode: str, out: Path) -> TrainConfig:
    common = dict(num_workers=0, output_dir=str(out), tensorboard=False, log_every=1, seed=7)
    if mode == "accum":
        return TrainConfig(model="tiny_vit", image_size=16, num_classes=4, batch_size=4,
                           grad_accum_steps=4, max_steps=3, optimizer="sgd", lr=0.1,
                           scheduler="constant", warmup_ratio=0.0, max_grad_norm=None,
                           resume=False, **common)
    if mode in ("resume", "hold"):
        return TrainConfig(model="tiny_cnn", image_size=16, num_classes=4, batch_size=4,
                           grad_accum_steps=2, max_steps=12, optimizer="adamw", lr=3e-3,
                           scheduler="cosine", warmup_ratio=0.2, max_grad_norm=1.0, resume=True,
                           **common)
    if mode == "zero":
        return TrainConfig(model="tiny_cnn", image_size=16, num_classes=4, batch_size=4,
                           max_steps=6, checkpoint_every=3, zero=True, powersgd=True,
                           resume=False, **common)
    raise SystemExit(f"unknown mode {mode!r}")


def main(mode: str, out: str) -> dict:
    from accelerate.utils import set_seed
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(mode, out)
    set_seed(cfg.seed)
    model = build(cfg.model, cfg.num_classes, cfg.image_size)
    if mode in ("resume", "hold"):
        # dropout draws from the global torch RNG: a resume that did not restore it would differ
        model.head = torch.nn.Sequential(torch.nn.Dropout(0.3), model.head)
    data = FixedImages()
    callbacks = []
    guards = True
    if mode == "hold":
        # HoldAt runs before the guards, so the preemption lands exactly at HOLD_STEP
        defaults = default_guards(cfg)
        preemption = next(g for g in defaults if isinstance(g, PreemptionGuard))
        callbacks, guards = [HoldAt(HOLD_STEP, out, preemption), *defaults], False
    if mode == "zero":
        callbacks = [Inspect(out)]
    summary = fit(model, data, cfg, callbacks=callbacks, guards=guards)
    rank = int(os.environ.get("RANK", "0"))
    save_file({k: p.detach().contiguous() for k, p in model.named_parameters()},
              str(out / f"rank{rank}.safetensors"))
    (out / f"summary_rank{rank}.json").write_text(json.dumps(summary, default=str))
    return summary


def main_many(modes: str, out: str) -> None:
    """Several modes one after the other in the same processes (one launch, one process group):
    results under out/<mode>."""
    for mode in modes.split(","):
        main(mode, str(Path(out) / mode))


if __name__ == "__main__":
    if sys.argv[1] == "notebook":
        from accelerate import notebook_launcher

        notebook_launcher(main_many, args=(sys.argv[2], sys.argv[3]), num_processes=int(sys.argv[4]))
    else:
        main(sys.argv[1], sys.argv[2])
