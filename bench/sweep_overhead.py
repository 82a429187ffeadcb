"""A sweep's overhead: gpu_lab.sweep against the same trials launched by hand, side by side.

The same configs (a grid of learning rates, no pruning) of tiny_cnn, 1 CPU rank each, `parallel`
at a time on the same slots: once by gpu_lab.sweep (driver, Optuna, SQLite study, records read for
the metric), once by a loop that launches the next run as soon as one ends, woken by the run's end
(Run.wait), as a notebook would. Wall time from the first call to the last run's end (for the
sweep: its wait() returning "finished"); what a kernel pays once (the launch code, Optuna's
storage) is paid before. The figure is hand / sweep (target: >= 0.95, a sweep no more than 5%
slower); each repeat runs both, alternating which goes first, and the spread is over the repeats'
paired ratios.

--shape bench: synthetic images drawn in memory, 16 px, batch 16, `--steps` steps, evaluated 4
times. --shape tutorial: tutorial 07's quick-mode trial (1500 images drawn at 96 px on disk, 32 px
inputs, batch 32, 100 steps, evaluated twice).

    GPU_LAB_QUICK=1 .venv/bin/python bench/sweep_overhead.py [--trials 4] [--parallel 2] \
        [--steps 200] [--shape bench|tutorial] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))
os.environ.setdefault("GPU_LAB_CLAIMS_DIR", tempfile.mkdtemp(prefix="gpu_lab_bench_claims_"))
os.environ.setdefault("GPU_LAB_CPU_SLOTS", "4")
os.environ.setdefault("GPU_LAB_QUICK", "1")

import accelerate  # noqa: E402,F401  (a training kernel has imported them; the driver does too)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402

LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-4, 3e-1, 1e-4, 2e-3, 5e-3, 2e-2, 5e-2]


def base(out: str, steps: int, shape: str) -> gpu_lab.TrainConfig:
    if shape == "tutorial":  # notebooks/07_tuning.ipynb, quick mode
        from gpu_lab.data import make_synthetic_images
        from gpu_lab.data.synthetic import TEXTURE_CLASSES

        images = make_synthetic_images(os.path.join(out, "images"), 1500, image_size=96,
                                       num_classes=len(TEXTURE_CLASSES),
                                       class_ids=TEXTURE_CLASSES)
        return gpu_lab.TrainConfig(model="tiny_cnn", data_dir=str(images.root),
                                   num_classes=len(TEXTURE_CLASSES), image_size=32,
                                   batch_size=32, max_steps=100, eval_every=50, log_every=1,
                                   num_workers=0, tensorboard=False, num_processes=1,
                                   output_dir=out)
    return gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=steps,
                               eval_every=max(steps // 4, 1), num_workers=0, tensorboard=False,
                               num_processes=1, output_dir=out)


def warm() -> None:
    """What a kernel pays once, not per sweep or per run, paid before the clocks: the launch code
    and Optuna's storage (SQLAlchemy and Alembic, about a second)."""
    from gpu_lab.launch import launch  # noqa: F401
    from gpu_lab.sweep import study

    study.storage_of(study.default_storage())


def by_sweep(cfg: gpu_lab.TrainConfig, lrs: list, parallel: int) -> float:
    t0 = time.monotonic()
    sw = gpu_lab.sweep(gpu_lab.train_classifier, cfg, {"lr": lrs}, trials=len(lrs),
                       parallel=parallel, sampler="grid", pruner=None)
    assert sw.wait(1800) == "finished", sw.trials
    elapsed = time.monotonic() - t0
    assert all(r["status"] == "complete" for r in sw.trials), sw.trials
    return elapsed


def by_hand(cfg: gpu_lab.TrainConfig, lrs: list, parallel: int) -> float:
    """Launch the next run when one ends, woken by the end itself (Run.wait), not by a poll."""
    ended = threading.Event()

    def start(lr: float) -> gpu_lab.Run:
        run = gpu_lab.launch(gpu_lab.train_classifier, cfg.replace(lr=lr))
        threading.Thread(target=lambda: (run.wait(), ended.set()), daemon=True).start()
        return run

    t0 = time.monotonic()
    todo, running = list(lrs), []
    while todo or running:
        ended.clear()  # cleared before the look: an end after it sets it again
        running = [r for r in running if not r.done]
        while todo and len(running) < parallel:
            running.append(start(todo.pop(0)))
        if running:
            ended.wait()
    elapsed = time.monotonic() - t0
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per trial (bench shape)")
    ap.add_argument("--shape", choices=("bench", "tutorial"), default="bench")
    a = ap.parse_args()
    if a.trials > len(LRS):
        ap.error(f"--trials: at most {len(LRS)}")
    cfg = base(tempfile.mkdtemp(prefix="gpu_lab_bench_out_"), a.steps, a.shape)
    lrs = LRS[:a.trials]
    warm()
    sweep_s, hand_s = [], []
    for i in range(a.repeats):
        first, second = (by_sweep, by_hand) if i % 2 == 0 else (by_hand, by_sweep)
        for f in (first, second):
            (sweep_s if f is by_sweep else hand_s).append(f(cfg, lrs, a.parallel))
        print(f"repeat {i + 1}: sweep {sweep_s[-1]:.1f} s, by hand {hand_s[-1]:.1f} s, "
              f"hand/sweep {hand_s[-1] / sweep_s[-1]:.3f}", flush=True)
    ratios = [h / s for h, s in zip(hand_s, sweep_s)]
    steps = 100 if a.shape == "tutorial" else a.steps
    print(f"{a.trials} trials of {steps} steps ({a.shape} shape), {a.parallel} at a time, "
          f"{a.repeats} repeats: sweep {statistics.median(sweep_s):.1f} s "
          f"({min(sweep_s):.1f}-{max(sweep_s):.1f}), by hand {statistics.median(hand_s):.1f} s "
          f"({min(hand_s):.1f}-{max(hand_s):.1f}); hand/sweep median of the paired ratios "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), ratio of the "
          f"medians {statistics.median(hand_s) / statistics.median(sweep_s):.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
