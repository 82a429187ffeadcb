"""Rank functions for the host-queue tests: tiny, CPU-only, torch-free."""
from __future__ import annotations

import os
import time

import gpu_lab


def quick(steps: int = 5) -> int:
    """A few reports at a training step's pace."""
    for i in range(steps):
        gpu_lab.report(i, loss=1.0 / (i + 1))
        time.sleep(0.05)  # a training step's pace
    return steps


def hold_until(go: str) -> int:
    """Report until the file `go` exists (at most 5 minutes): a run that holds its devices for as
    long as the test needs."""
    step, deadline = 0, time.monotonic() + 300
    while not os.path.exists(go) and time.monotonic() < deadline:
        gpu_lab.report(step, loss=float(step))
        step += 1
        time.sleep(0.02)  # a training step's pace
    return step
