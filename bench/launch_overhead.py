"""Time to first step: gpu_lab.launch against bare accelerate.notebook_launcher.

Same training function, 2 CPU ranks (gloo), runs alternated, fresh free port each time. The clock
starts just before the launch call and stops when rank 0 finishes its first optimizer step (rank 0
writes time.time() to a file). Prints the medians and their ratio (target: <= 1.15).

    .venv/bin/python bench/launch_overhead.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))

import accelerate  # noqa: E402  (both sides start from a kernel that has imported it)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402
from gpu_lab.launch import free_port  # noqa: E402


def train(stamp: str, steps: int = 3):
    import torch as t

    acc = gpu_lab.accelerator()
    model = t.nn.Linear(32, 8)
    opt = t.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    for step in range(steps):
        loss = model(t.randn(16, 32)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 0 and acc.is_main_process:
            Path(stamp).write_text(repr(time.time()))
        gpu_lab.report(step, loss=loss.detach())


def first_step_gpu_lab(stamp: Path) -> float:
    t0 = time.time()
    run = gpu_lab.launch(train, str(stamp), num_processes=2)
    assert run.wait(300) == "succeeded", run.logs(None)
    return float(stamp.read_text()) - t0


def first_step_bare(stamp: Path) -> float:
    t0 = time.time()
    accelerate.notebook_launcher(train, args=(str(stamp),), num_processes=2,
                                 use_port=str(free_port()))
    return float(stamp.read_text()) - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ours, bare = [], []
    for i in range(a.repeats + 1):  # the first pair warms the page cache and is discarded
        for fn, out in ((first_step_gpu_lab, ours), (first_step_bare, bare)) if i % 2 else \
                ((first_step_bare, bare), (first_step_gpu_lab, ours)):
            stamp = tmp / f"stamp-{i}-{fn.__name__}"
            dt = fn(stamp)
            if i:
                out.append(dt)
    mo, mb = statistics.median(ours), statistics.median(bare)
    print(f"time to first step, 2 CPU ranks, median of {a.repeats} alternated runs:")
    print(f"  bare notebook_launcher: {mb:.3f} s   ({', '.join(f'{x:.2f}' for x in bare)})")
    print(f"  gpu_lab.launch:         {mo:.3f} s   ({', '.join(f'{x:.2f}' for x in ours)})")
    print(f"  ratio gpu_lab / bare:   {mo / mb:.3f}  (target <= 1.15)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
