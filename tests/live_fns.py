"""Runs for the browser test of a server that goes away (tests/test_browser.py): they report at
a steady pace while the test stops and restarts the lab's server, so that what a view holds can
be compared with the run's record, step by step."""
from __future__ import annotations

import time

import gpu_lab


def report_steadily(steps: int, every: float = 0.1):
    """A step every `every` seconds: its loss; `ram` nearly flat (1.339 GiB, give or take 20 KiB:
    the host RAM chart of issue 60, whose ticks all read "1.339"); and at step 0 only,
    `eval_loss` (a chart of one point)."""
    import torch

    acc = gpu_lab.accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    for step in range(steps):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        acc.backward(loss)
        extra = {"eval_loss": 0.5} if step == 0 else {}
        gpu_lab.report(step, loss=loss.detach(), ram=1.339 + 2e-5 * (step % 3), **extra)
        time.sleep(every)
    return {"steps": steps}
