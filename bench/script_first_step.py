"""Time to first step of a user's own script: gpu_lab.launch("train.py", ...) against
`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 train.py ...`,
side by side.

The same script (written the accelerate way, never importing gpu_lab: tests/own_code/
train_accel.py), 2 CPU ranks (gloo) on each side, alternated pair by pair. The clock starts as the
command is given and stops when rank 0 has finished its first optimizer step (the script writes
time.time() to --stamp). The gpu_lab side launches from this process, which has imported
gpu_lab, torch and accelerate as a notebook that trains would have: its ranks are forks of it.
`accelerate launch` starts from the shell, as a terminal user would: a fresh interpreter for the
launcher and for each rank. Prints each side's median and the median of the paired ratios with
its range (target: <= 1.0).

    .venv/bin/python bench/script_first_step.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))

import accelerate  # noqa: E402,F401  (what a notebook that trains has imported)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "own_code" / "train_accel.py"
ARGS = ["--lr", "0.01", "--steps", "3", "--log-with", "all"]


def first_step_gpu_lab(stamp: Path, out: Path) -> float:
    t0 = time.time()
    run = gpu_lab.launch(str(SCRIPT), *ARGS, "--out", str(out), "--stamp", str(stamp),
                         num_processes=2)
    assert run.wait(300) == "succeeded", (run.error, run.logs(0))
    return float(stamp.read_text()) - t0


def first_step_accelerate_launch(stamp: Path, out: Path) -> float:
    accelerate_cli = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    # On a host without GPUs `--cpu --num_processes 2` starts one process (its multi-CPU path is
    # mpirun's), and `--multi_gpu` two that each train alone (DistributedType.NO); accelerate's
    # CPU switch in the environment makes them one gloo group, as gpu_lab's ranks are.
    env = dict(os.environ, ACCELERATE_USE_CPU="true")
    t0 = time.time()
    subprocess.run([accelerate_cli, "launch", "--multi_gpu", "--num_processes", "2",
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    str(SCRIPT), *ARGS, "--out", str(out), "--stamp", str(stamp)],
                   check=True, capture_output=True, env=env)
    first = float(stamp.read_text()) - t0
    assert '"num_processes": 2' in (out / "rank1.json").read_text()  # one group, not two copies
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_script_bench_"))
    sides = {"gpu_lab.launch": first_step_gpu_lab,
             "accelerate launch": first_step_accelerate_launch}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(a.repeats + 1):  # the first pair warms the page cache and is discarded
        order = list(sides.items()) if i % 2 else list(sides.items())[::-1]
        for name, fn in order:
            dt = fn(tmp / f"stamp-{i}-{len(times[name])}-{fn.__name__}", tmp / f"out-{i}-{name}")
            if i:
                times[name].append(dt)
    ours, theirs = times["gpu_lab.launch"], times["accelerate launch"]
    ratios = sorted(o / t for o, t in zip(ours, theirs))
    print(f"time to first step of {SCRIPT.name}, 2 CPU ranks, {a.repeats} alternated pairs:")
    for name, xs in times.items():
        print(f"  {name:18s} {statistics.median(xs):.3f} s   ({', '.join(f'{x:.2f}' for x in xs)})")
    print(f"  ratio gpu_lab / accelerate launch: {statistics.median(ratios):.3f} "
          f"({ratios[0]:.3f}-{ratios[-1]:.3f})  (target <= 1.0)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
