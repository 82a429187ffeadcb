"""A sweep's overhead: gpu_lab.sweep against the same trials launched by hand, side by side.

The same configs (a grid of learning rates, no pruning) of tiny_cnn on synthetic images, 1 CPU
rank each, `parallel` at a time on the same slots: once by gpu_lab.sweep (driver, Optuna, SQLite
study, records read for the metric), once by a loop that launches the next run as soon as one
ends. Wall time from the first call to the last run's end; the figure is hand / sweep (target:
>= 0.95, a sweep no more than 5% slower). Runs alternate over `--repeats`.

    GPU_LAB_QUICK=1 .venv/bin/python bench/sweep_overhead.py [--trials 4] [--parallel 2] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))
os.environ.setdefault("GPU_LAB_CLAIMS_DIR", tempfile.mkdtemp(prefix="gpu_lab_bench_claims_"))
os.environ.setdefault("GPU_LAB_CPU_SLOTS", "4")
os.environ.setdefault("GPU_LAB_QUICK", "1")

import accelerate  # noqa: E402,F401  (a training kernel has imported them; the driver does too)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402

LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-4, 3e-1, 1e-4]


def base(out: str, steps: int) -> gpu_lab.TrainConfig:
    return gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=steps,
                               eval_every=max(steps // 4, 1), num_workers=0, tensorboard=False, num_processes=1,
                               output_dir=out)


def by_sweep(cfg: gpu_lab.TrainConfig, lrs: list, parallel: int) -> float:
    t0 = time.monotonic()
    sw = gpu_lab.sweep(gpu_lab.train_classifier, cfg, {"lr": lrs}, trials=len(lrs),
                       parallel=parallel, sampler="grid", pruner=None)
    assert sw.wait(1800) == "finished", sw.trials
    assert all(r["status"] == "complete" for r in sw.trials), sw.trials
    return time.monotonic() - t0


def by_hand(cfg: gpu_lab.TrainConfig, lrs: list, parallel: int) -> float:
    t0 = time.monotonic()
    todo, running = list(lrs), []
    while todo or running:
        running = [r for r in running if not r.done]
        while todo and len(running) < parallel:
            running.append(gpu_lab.launch(gpu_lab.train_classifier, cfg.replace(lr=todo.pop())))
        time.sleep(0.5)  # the sweep's driver reads its trials this often too
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per trial")
    a = ap.parse_args()
    cfg, lrs = base(tempfile.mkdtemp(prefix="gpu_lab_bench_out_"), a.steps), LRS[:a.trials]
    sweep_s, hand_s = [], []
    for i in range(a.repeats):
        first, second = (by_sweep, by_hand) if i % 2 == 0 else (by_hand, by_sweep)
        for f in (first, second):
            (sweep_s if f is by_sweep else hand_s).append(f(cfg, lrs, a.parallel))
    s, h = statistics.median(sweep_s), statistics.median(hand_s)
    print(f"{a.trials} trials of {a.steps} steps, {a.parallel} at a time: sweep {s:.1f} s, by hand {h:.1f} s; "
          f"hand/sweep = {h / s:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
