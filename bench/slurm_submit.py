"""A Slurm job followed from the notebook: time to first step, gpu_lab.submit on a private one-node
cluster against gpu_lab.launch on this host, and how late the kernel sees a report.

Same training function, 2 CPU ranks, runs alternated. The clock starts just before the call and
stops when the kernel's Run handle has seen rank 0's first report (wait_for_step), which is what a
user watching the dashboard waits for: for submit that includes sbatch, Slurm's scheduling, srun
starting fresh interpreters (a launch forks ranks that have torch imported already) and the report
crossing the run's channel to the recorder in the registry's follower. Also printed: how long
submit() itself takes (the notebook's cell), and the delay from a report's time stamp to the
kernel's handle, for both.

    .venv/bin/python bench/slurm_submit.py [--repeats 3]
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
os.environ.setdefault("GPU_LAB_SLURM_POLL_S", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the job imports bench.slurm_submit

import accelerate  # noqa: E402,F401  (a training kernel has imported them)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402
from gpu_lab.cluster import sandbox  # noqa: E402

STEPS = 20


def train(config=None):
    """A few small steps on 2 ranks, each reported with its wall time."""
    import torch as t

    acc = gpu_lab.accelerator()
    model = t.nn.Linear(32, 8)
    opt = t.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    for step in range(STEPS):
        loss = model(t.randn(16, 32)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        gpu_lab.report(step, loss=loss.detach(), sent=time.time())
        time.sleep(0.05)  # a step's pace, so the kernel follows a run that is still going


def _measure(start) -> tuple[float, float, float]:
    """(seconds in the call, seconds to the first step seen, median report delay)."""
    seen: list[float] = []
    t0 = time.time()
    run = start()
    called = time.time() - t0

    def on_events(events: list) -> None:
        now = time.time()
        seen.extend(now - e["data"]["sent"] for e in events
                    if e.get("kind") == "metric" and e.get("rank") == 0
                    and isinstance(e.get("data"), dict) and "sent" in e["data"])

    run.subscribe(on_events)
    assert run.wait_for_step(0, timeout=300), run.status
    first = time.time() - t0
    assert run.wait(300) == "succeeded", (run.status, run.reason, run.logs(None, 20))
    return called, first, statistics.median(seen) if seen else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not sandbox.installed():
        sys.exit("bench/slurm_submit.py: needs Slurm's daemons (make test installs them)")
    cfg = gpu_lab.TrainConfig(num_workers=0, num_processes=2,
                              output_dir=tempfile.mkdtemp(prefix="gpu_lab_bench_out_"))
    out: dict[str, list] = {"submit": [], "launch": []}
    with sandbox.private_cluster(Path(tempfile.mkdtemp(prefix="gpls-")) / "s", cpus=4):
        for i in range(a.repeats):
            order = ("submit", "launch") if i % 2 == 0 else ("launch", "submit")
            for how in order:
                start = (lambda: gpu_lab.submit("bench.slurm_submit:train", cfg, device="cpu")) \
                    if how == "submit" else (lambda: gpu_lab.launch(train, cfg))
                out[how].append(_measure(start))
    med = {k: [statistics.median(x[j] for x in v) for j in range(3)] for k, v in out.items()}
    for how, (called, first, delay) in med.items():
        firsts = ", ".join(f"{x[1]:.2f}" for x in out[how])
        print(f"{how:>6}: call {called * 1000:.0f} ms, first step seen {first:.2f} s "
              f"({firsts}), report to kernel {delay * 1000:.1f} ms (medians of {a.repeats})")
    print(f"first step seen, submit / launch = {med['submit'][1] / med['launch'][1]:.2f}")


if __name__ == "__main__":
    main()
