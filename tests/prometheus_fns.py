"""The training function the Prometheus test runs on 2 ranks: it reports what gpu_lab.train.fit
logs (loss, samples_per_s, step_time, data_wait, lr) until the run is stopped."""
from __future__ import annotations

import time

import gpu_lab


def report_until_stopped(period: float = 0.05) -> None:
    step = 0
    while True:
        gpu_lab.report(step, loss=2.0 / (step + 1), samples_per_s=256.0, step_time=0.1,
                       data_wait=0.025, lr=0.01)
        step += 1
        time.sleep(period)  # the pace of a (very) small training step, not a synchronisation
