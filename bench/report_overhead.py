"""Cost of gpu_lab.report(): per call in a tight loop, and on a ~2 ms training step.

The run's recorder runs in another process, as it does for a launched run. Prints µs per call (target < 5) and the
slowdown of a 2 ms step that reports every step, with and without report(), runs interleaved
(target < 1%).

    .venv/bin/python bench/report_overhead.py
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from gpu_lab.record import Reporter


def _drain(address_q, stop_evt):
    import tempfile

    from gpu_lab.record.registry import Registry
    from gpu_lab.record.recorder import Recorder

    reg = Registry(tempfile.mkdtemp(prefix="gpu_lab_bench_") + "/registry.db")
    reg.create_run("bench", status="running")
    rec = Recorder(reg, "bench")
    address_q.put((rec.address, rec.client_key.encode()))  # the run's channel is CURVE
    stop_evt.wait()
    rec.close()
    print(f"recorder stored {rec.written} events", flush=True)


def step_fn(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def main() -> None:
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_drain, args=(q, stop))
    proc.start()
    address, key = q.get(timeout=60)
    rep = Reporter(address=address, key=key, run_id="bench", rank=0)

    # 1. tight loop
    n = 200_000
    rep.report(0, loss=1.0)
    t0 = time.perf_counter()
    for i in range(n):
        rep.report(i, loss=0.5, lr=1e-3)
    per_call = (time.perf_counter() - t0) / n * 1e6
    base = time.perf_counter()
    for i in range(n):
        pass
    empty = (time.perf_counter() - base) / n * 1e6
    print(f"report(step, loss=, lr=): {per_call - empty:.2f} µs per call "
          f"(loop overhead {empty:.2f} µs removed; {rep.dropped} dropped of {n})")

    # 2. a ~2 ms training step with and without report(), interleaved
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x = torch.randn(64, 512)
    for _ in range(20):
        step_fn(model, x)
    t0 = time.perf_counter()
    for _ in range(50):
        step_fn(model, x)
    step_ms = (time.perf_counter() - t0) / 50 * 1e3
    rounds, steps = 15, 200
    with_r, without = [], []
    for r in range(rounds):
        for mode in ((0, 1) if r % 2 else (1, 0)):
            t0 = time.perf_counter()
            for s in range(steps):
                loss = step_fn(model, x)
                if mode:
                    rep.report(s, loss=loss, lr=1e-3, step_time=0.002)
            (with_r if mode else without).append(time.perf_counter() - t0)
    a, b = statistics.median(with_r), statistics.median(without)
    print(f"training step ≈ {step_ms:.2f} ms; median of {rounds} interleaved rounds of {steps} steps:")
    print(f"  without report: {b * 1e3 / steps:.3f} ms/step, with report: {a * 1e3 / steps:.3f} "
          f"ms/step, slowdown {100 * (a / b - 1):+.2f}% (target < 1%)")
    rep.close(2.0)
    stop.set()
    proc.join(10)


if __name__ == "__main__":
    main()
