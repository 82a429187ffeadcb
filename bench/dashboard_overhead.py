"""Training throughput with and without the Dashboard and telemetry attached (target: ratio >= 0.98).

The same 2-rank CPU run of gpu_lab.train.train_classifier (tiny_cnn on synthetic images, gloo),
launched through gpu_lab.launch, alternately without and with a Dashboard(run) created right after
the launch: LivePlot redrawing up to 4 Hz on the receiver thread, RunInfo tailing logs, GPUPanel
sampling NVML + psutil every second on the shared sampler thread — what a notebook shows. The order
of the pair flips every repeat, so a drift in machine load hits both sides alike.

It also prints this process's CPU use during each run (receiver, registry writes, and with the
dashboard its redraws and the sampler), as a share of one core: the cost the dashboard adds there
is what it can take from the workers on a host whose cores they saturate.

Throughput is measured inside the workers: samples trained between rank 0's report at step
`--skip` and its last report, over the time between those two reports (worker-side timestamps of
the events), so process start-up and torch import do not count. Outside a Jupyter kernel the widget
messages are serialised but not sent (ipywidgets' dummy comm); everything else is the real path.

    .venv/bin/python bench/dashboard_overhead.py [--repeats 3] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_bench_"))

import gpu_lab  # noqa: E402
from gpu_lab.config import TrainConfig  # noqa: E402
from gpu_lab.train import train_classifier  # noqa: E402

FINAL = ("succeeded", "failed", "stopped", "lost")


def throughput(run, batch_size: int, skip: int) -> float:
    steps, _ = run.metrics.series("loss", 0)
    times = run.metrics.times("loss", 0)
    pts = [(s, t) for s, t in zip(steps, times) if s >= skip]
    if len(pts) < 2:
        raise RuntimeError(f"run {run.id}: only {len(pts)} reports after step {skip}")
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    return (s1 - s0) * batch_size * run.num_processes / (t1 - t0)


def one_run(cfg: TrainConfig, with_dashboard: bool, skip: int) -> tuple[float, float]:
    """(throughput in samples/s, this process's CPU use during the run as a share of one core)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    run = gpu_lab.launch(train_classifier, cfg, config=cfg, num_processes=cfg.num_processes,
                         mixed_precision=cfg.mixed_precision)
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
        flushes = dash.liveplot.flushes
        dash.close()
        print(f"    (dashboard: {flushes} plot redraws, "
              f"{len(dash.gpupanel.samples) if dash.gpupanel else 0} telemetry samples)")
    return throughput(run, cfg.batch_size, skip), cpu_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs (default 3)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps not measured (default 10)")
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="gpu_lab_bench_out_")
    cfg = TrainConfig(model="tiny_cnn", image_size=32, num_classes=10, batch_size=args.batch_size,
                      max_steps=args.steps, epochs=None, num_processes=2, num_workers=0,
                      augment="none", log_every=1, eval_every=10**9, checkpoint_every=0,
                      tensorboard=False, resume=False, output_dir=out)
    # A kernel imports plotly once, for its first dashboard (a few seconds here: plotly pulls in
    # nbformat and jsonschema). Pay that before measuring: the steady-state cost is the question.
    from gpu_lab.widgets import LivePlot

    LivePlot().close()
    print(f"2-rank CPU train_classifier, {args.steps} steps × batch {args.batch_size} per rank, "
          f"{args.repeats} interleaved pairs")
    results: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        for with_dash in order:
            sps, share = one_run(cfg, with_dash, args.skip)
            results[with_dash].append(sps)
            cpu[with_dash].append(share)
            print(f"  pair {i + 1}: {'with   ' if with_dash else 'without'} dashboard "
                  f"{sps:8.1f} samples/s   kernel-side CPU {100 * share:5.1f}% of a core",
                  flush=True)
    base = statistics.median(results[False])
    dash = statistics.median(results[True])
    print(f"median without dashboard: {base:.1f} samples/s, kernel-side CPU "
          f"{100 * statistics.median(cpu[False]):.1f}% of a core")
    print(f"median with dashboard:    {dash:.1f} samples/s, kernel-side CPU "
          f"{100 * statistics.median(cpu[True]):.1f}% of a core")
    ratio = dash / base
    print(f"throughput ratio (with / without): {ratio:.3f}  (target >= 0.98: "
          f"{'met' if ratio >= 0.98 else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
