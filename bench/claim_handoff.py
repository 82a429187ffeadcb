"""The queue's hand-off: from a run's end to the next queued run's first step, against launching
that run directly on a free host.

A host with 2 CPU slots (GPU_LAB_CPU_SLOTS=2) and a claims folder and registry of this script's
own. Both sides run the same 2-rank training function as bench/launch_overhead.py (gloo), alternated,
fresh port each time:
- direct: the host is free; the clock runs from the launch() call to rank 0's first optimizer step;
- hand-off: a run A holds both slots while run B waits `queued`; A is told to finish, and the
  clock runs from the moment A's training function returns on rank 0 (its last step done) to B's
  first step. It includes A's teardown (ranks exit, end recorded, claim released), B's wake-up
  (the bell), its claim and the start of its ranks.
Prints the medians, their spread, where the hand-off goes, and the median of the paired ratios
(target: hand-off <= 1.2 x direct).

    .venv/bin/python bench/claim_handoff.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = tempfile.mkdtemp(prefix="gpu_lab_bench_handoff_")
os.environ.setdefault("GPU_LAB_HOME", os.path.join(_HERE, "home"))
os.environ["GPU_LAB_CPU_SLOTS"] = "2"  # one 2-rank run fills the host: the next one queues
os.environ["GPU_LAB_CLAIMS_DIR"] = os.path.join(_HERE, "claims")  # not the host's real queue

import accelerate  # noqa: E402,F401  (both sides start from a kernel that has imported it)
import torch  # noqa: E402,F401

import gpu_lab  # noqa: E402
from bench.launch_overhead import train  # noqa: E402  (the launch benchmark's own function)


def hold(stamp: str, go: str, end: str) -> None:
    """Run A: the same first steps, then report until the file `go` exists (it holds its slots);
    rank 0 stamps `end` as the function returns."""
    train(stamp)
    step = 3
    while not os.path.exists(go):
        gpu_lab.report(step, loss=1.0)
        step += 1
        time.sleep(0.01)  # a held run's pace: its polls of `go` leave the cores to the rest
    if gpu_lab.accelerator().is_main_process:
        Path(end).write_text(repr(time.time()))


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.005)  # a script polling for a file: the tick is part of no measured span


def direct(tmp: Path, i: int) -> float:
    stamp = tmp / f"direct-{i}"
    t0 = time.time()
    run = gpu_lab.launch(train, str(stamp), num_processes=2, name=f"direct-{i}")
    assert run.wait(300) == "succeeded", run.logs(None)
    return float(stamp.read_text()) - t0


def handoff(tmp: Path, i: int) -> float:
    a_stamp, go, a_end, b_stamp = (tmp / f"{x}-{i}" for x in ("a", "go", "a-end", "b"))
    a = gpu_lab.launch(hold, str(a_stamp), str(go), str(a_end), num_processes=2, name=f"a-{i}")
    _until(a_stamp.exists, 300, "run A's first step")
    b = gpu_lab.launch(train, str(b_stamp), num_processes=2, name=f"b-{i}")
    _until(lambda: b.status == "queued", 60, "run B queued")
    go.write_text("")
    assert a.wait(300) == "succeeded", a.logs(None)
    assert b.wait(300) == "succeeded", b.logs(None)
    ended, first = float(a_end.read_text()), float(b_stamp.read_text())
    rows = [a._registry.get_run(r.id) for r in (a, b)]
    # where the hand-off goes: A's teardown, the claim passing over, B's ranks starting
    parts[i] = (rows[0]["ended"] - ended, rows[1]["started"] - rows[0]["ended"],
                first - rows[1]["started"])
    return first - ended


parts: dict[int, tuple[float, float, float]] = {}


def _show(name: str, xs: list[float]) -> str:
    spread = f"{min(xs):.3f}-{max(xs):.3f}"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return (f"  {name:<22} median {statistics.median(xs):.3f} s   spread {spread} s  "
            f"sd {sd:.3f}   ({', '.join(f'{x:.2f}' for x in xs)})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.repeats < 1:
        sys.exit(f"--repeats: got {a.repeats}; accepted: 1 or more")
    tmp = Path(_HERE) / "stamps"
    tmp.mkdir()
    ours, bare = [], []
    for i in range(a.repeats + 1):  # the first pair warms the page cache and is discarded
        pair = ((handoff, ours), (direct, bare)) if i % 2 else ((direct, bare), (handoff, ours))
        for fn, out in pair:
            dt = fn(tmp, i)
            if i:
                out.append(dt)
    mo, mb = statistics.median(ours), statistics.median(bare)
    ratios = [o / b for o, b in zip(ours, bare)]
    print(f"hand-off vs direct launch, 2-rank CPU runs on 2 slots, {a.repeats} alternated pairs:")
    print(_show("direct (launch->step)", bare))
    print(_show("hand-off (end->step)", ours))
    split = [statistics.median(p[k] for i, p in parts.items() if i) for k in range(3)]
    print(f"  hand-off, medians: A's teardown (fn return -> ended) {split[0]:.3f} s, claim "
          f"(A ended -> B started) {split[1]:.3f} s, B's ranks (started -> step) {split[2]:.3f} s")
    print(f"  paired ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"  ratio of the medians: {mo / mb:.3f}")
    # the VM's speed swings between pairs: the median of paired ratios is the figure
    print(f"  ratio hand-off / direct, median of paired ratios: {statistics.median(ratios):.3f}"
          f"  (target <= 1.2)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
