"""Training throughput with and without the Dashboard and telemetry attached (target: ratio >= 0.98).

The training: 2-rank CPU gpu_lab.train.train_classifier (tiny_cnn on synthetic images, gloo),
launched through gpu_lab.launch. "With" means what a notebook shows: a Dashboard(run) — LivePlot
redrawing up to 4 Hz on the receiver thread, RunInfo tailing logs, GPUPanel sampling NVML + psutil
every second on the shared sampler thread.

Two measurements, both interleaved, both printed as a median of paired ratios:

A. whole runs: the same run without and with a Dashboard created right after the launch, in pairs
   whose order flips every time (ABBA), so a drift in machine load hits both sides alike;
B. one long run, its Dashboard built once, then attached and detached in alternating windows of a
   few seconds (ABBA again): the steady-state cost, free of the run-to-run spread of A (which ranks
   land on which core, page placement), which on a small VM is larger than the effect measured.

Throughput is measured inside the workers: samples trained per second between rank 0's reports
(worker-side timestamps), so process start-up and torch import do not count. Each pair gives one
ratio (with / without); the script prints their median, quartiles and a bootstrap 90% interval of
the median. On a shared 2-vCPU VM even a bare matmul loop swings ±30% from one 2 s window to the
next, so a single pair means little: use many pairs.

It also prints this process's CPU use (receiver, registry writes and, with the dashboard, its
redraws and the sampler) as a share of one core: what the dashboard can take from workers that
saturate the cores. Outside a Jupyter kernel the widget messages are serialised but not sent
(ipywidgets' dummy comm); everything else is the real path.

    .venv/bin/python bench/dashboard_overhead.py [--pairs 8] [--steps 300] [--windows 40] [--window-s 3]
"""
from __future__ import annotations

import argparse
import bisect
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))

import gpu_lab  # noqa: E402
from gpu_lab.config import TrainConfig  # noqa: E402
from gpu_lab.train import train_classifier  # noqa: E402

TARGET = 0.98


def summary(ratios: list[float], seed: int = 0) -> str:
    """median [q1, q3], and a bootstrap 90% interval of the median."""
    med = statistics.median(ratios)
    if len(ratios) < 4:
        return f"{med:.3f} (only {len(ratios)} pairs)"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    lo, hi = boot[int(0.05 * len(boot))], boot[int(0.95 * len(boot)) - 1]
    return (f"{med:.3f}  (quartiles {q1:.3f}–{q3:.3f}; 90% interval of the median "
            f"{lo:.3f}–{hi:.3f}; {len(ratios)} pairs)")


def rank0_rate(run, batch_size: int, t0: float = float("-inf"), t1: float = float("inf"),
               skip: int = 0) -> float:
    """Samples/s over all ranks, from rank 0's reports between wall times t0 and t1."""
    steps, _ = run.metrics.series("loss", 0)
    times = run.metrics.times("loss", 0)
    first = bisect.bisect_left(steps, skip)
    steps, times = steps[first:], times[first:]
    a = bisect.bisect_left(times, t0)
    b = bisect.bisect_right(times, t1) - 1
    if b - a < 2:
        raise RuntimeError(f"run {run.id}: only {max(0, b - a + 1)} reports in the window")
    return (steps[b] - steps[a]) * batch_size * run.num_processes / (times[b] - times[a])


def config(steps: int, batch_size: int) -> TrainConfig:
    return TrainConfig(model="tiny_cnn", image_size=32, num_classes=10, batch_size=batch_size,
                       max_steps=steps, epochs=None, num_processes=2, num_workers=0,
                       augment="none", log_every=1, eval_every=10**9, checkpoint_every=0,
                       tensorboard=False, resume=False,
                       output_dir=tempfile.mkdtemp(prefix="gpu_lab_bench_out_"))


def launch(cfg: TrainConfig):
    return gpu_lab.launch(train_classifier, cfg)


def one_run(cfg: TrainConfig, with_dashboard: bool, skip: int) -> tuple[float, float]:
    """(throughput in samples/s, this process's CPU use during the run as a share of one core)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    run = launch(cfg)
    dash = None
    if with_dashboard:
        from gpu_lab.widgets import Dashboard

        dash = Dashboard(run)
    status = run.wait(600)
    cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    if status != "succeeded":
        raise RuntimeError(f"run {run.id} {status}: {run.error}\n{run.logs(0, 30)}")
    if dash is not None:
        deadline = time.monotonic() + 10  # let the views finish their last redraw, then detach
        while time.monotonic() < deadline and dash.gpupanel is not None and dash.gpupanel.listening:
            time.sleep(0.05)
        dash.close()
    return rank0_rate(run, cfg.batch_size, skip=skip), cpu_share


def whole_runs(args) -> list[float]:
    cfg = config(args.steps, args.batch_size)
    print(f"A. whole runs: {args.steps} steps × batch {args.batch_size} per rank, "
          f"{args.pairs} interleaved pairs (ABBA)", flush=True)
    ratios, cpu = [], {False: [], True: []}
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {}
        for with_dash in order:
            got[with_dash], share = one_run(cfg, with_dash, args.skip)
            cpu[with_dash].append(share)
        ratios.append(got[True] / got[False])
        print(f"  pair {i + 1:2d}: without {got[False]:7.1f}  with {got[True]:7.1f} samples/s  "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"  kernel-side CPU: {100 * statistics.median(cpu[False]):.1f}% of a core without, "
          f"{100 * statistics.median(cpu[True]):.1f}% with (construction included)")
    print(f"  ratio with / without: {summary(ratios)}", flush=True)
    return ratios


def windows(args) -> list[float]:
    cfg = config(10**7, args.batch_size)
    print(f"B. one run, Dashboard attached / detached in {args.windows} alternating windows of "
          f"{args.window_s:g} s (ABBA)", flush=True)
    run = launch(cfg)
    try:
        if not run.wait_for_step(args.skip, timeout=300):
            raise RuntimeError(f"run {run.id} {run.status}: {run.error}")
        w = attach_detach_windows(run, cfg.batch_size, args.windows, args.window_s)
    finally:
        run.stop()
    print(f"  dashboard built in {w['build_ms']:.0f} ms of CPU; kernel-side CPU "
          f"{100 * w['cpu_detached']:.1f}% of a core detached, "
          f"{100 * w['cpu_attached']:.1f}% attached")
    print(f"  ratio attached / detached: {summary(w['ratios'])}", flush=True)
    return w["ratios"]


def caught_up(run, t: float, timeout: float = 60.0) -> None:
    """Wait until rank 0's record holds a loss report stamped at wall time `t` or later (or the
    run ended, or `timeout` passed): each wake is a new report, not a poll."""
    deadline = time.monotonic() + timeout
    while not run.done and time.monotonic() < deadline:
        times = run.metrics.times("loss", 0)
        if times and times[-1] >= t:
            return
        steps, _ = run.metrics.series("loss", 0)
        try:
            run.wait_for_step((steps[-1] if steps else 0) + 1, timeout=deadline - time.monotonic())
        except TimeoutError:
            return


def step_rate(run) -> float:
    """Rank 0's optimizer steps per second so far, from its reports' worker-side stamps."""
    steps, _ = run.metrics.series("loss", 0)
    times = run.metrics.times("loss", 0)
    if len(steps) < 2 or times[-1] <= times[0]:
        return 0.0
    return (steps[-1] - steps[0]) / (times[-1] - times[0])


def attach_detach_windows(run, batch_size: int, n_windows: int, window_s: float) -> dict:
    """A Dashboard on a running `run`, attached and detached in `n_windows` alternating windows
    (ABBA): the ratios of rank 0's throughput attached / detached, one per pair of windows, and
    this process's CPU share in each state. bench/gpu_check.py calls it during a GPU run."""
    from gpu_lab.widgets import Dashboard

    c0 = time.process_time()
    dash = Dashboard(run, stop_telemetry_at_end=False)
    build_ms = 1000 * (time.process_time() - c0)
    views = (dash.liveplot.attach, dash.info.attach, dash.gpupanel.start)
    unviews = (dash.liveplot.detach, dash.info.detach, dash.gpupanel.stop)
    spans: list[tuple[bool, float, float, float]] = []
    try:
        for i in range(n_windows):
            on = i % 4 in (1, 2)  # off on on off | off on on off ...
            for fn in views if on else unviews:
                fn()
            t0, c0 = time.time(), time.process_time()
            time.sleep(window_s)
            spans.append((on, t0, time.time(), time.process_time() - c0))
    finally:
        for fn in unviews:
            fn()
    # Reports reach the record a moment after the worker stamps them; on a loaded machine the last
    # window's would still be in flight here.
    caught_up(run, spans[-1][2])
    rates = [(on, rank0_rate(run, batch_size, t0 + 0.2, t1), cpu / (t1 - t0))
             for on, t0, t1, cpu in spans]
    ratios = []
    for (on1, r1, _), (on2, r2, _) in zip(rates[0::2], rates[1::2]):
        ratios.append(r2 / r1 if on2 else r1 / r2)
    return {"ratios": ratios, "build_ms": build_ms,
            "cpu_attached": statistics.median(c for on, _, c in rates if on),
            "cpu_detached": statistics.median(c for on, _, c in rates if not on)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="A: pairs of whole runs (default 8)")
    ap.add_argument("--steps", type=int, default=300, help="A: optimizer steps per run (default 300)")
    ap.add_argument("--windows", type=int, default=40, help="B: windows, half of them attached "
                                                            "(default 40)")
    ap.add_argument("--window-s", type=float, default=3.0, help="B: seconds per window (default 3)")
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps not measured (default 10)")
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    if args.pairs < 1 or args.windows < 2 or args.windows % 2:
        ap.error("--pairs must be >= 1 and --windows an even number >= 2")
    # A kernel imports plotly once, for its first dashboard (a few seconds here: plotly pulls in
    # nbformat and jsonschema). Pay that before measuring: the steady-state cost is the question.
    from gpu_lab.widgets import LivePlot

    LivePlot().close()
    a = whole_runs(args)
    b = windows(args)
    ratio = statistics.median(a + b)
    print(f"throughput ratio (with / without), median of all {len(a) + len(b)} pairs: {ratio:.3f}  "
          f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
