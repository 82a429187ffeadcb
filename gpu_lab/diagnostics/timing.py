"""StepTimer: where the time of each training step goes, measured by the worker itself.

    timer = StepTimer()
    for step in range(steps):
        with timer.phase("data"):
            x, y = next(it)
        with timer.phase("forward_backward"):
            loss = loss_fn(model(x), y); accelerator.backward(loss)
        with timer.phase("optimizer"):
            opt.step(); opt.zero_grad()
        timer.step(step, samples=len(y))     # reports through gpu_lab.report

It reports, in seconds per optimizer step, the names the bottleneck finder reads: `step_time`
(wall time from one step() to the next), `data_wait`, `fwd_bwd_time`, `optimizer_time`,
`comm_time` (a "comm" phase, for explicit collectives), and `samples_per_s`. gpu_lab.train.fit
reports `step_time`, `data_wait` and `samples_per_s` under the same names.

On a GPU the CPU runs ahead of the device, so a phase measured on the CPU clock shows when its
kernels were queued, not when they ran. `sync=True` (the default on CUDA) calls
torch.cuda.synchronize() at each phase boundary: exact phases, at the price of removing the overlap
between queueing and running — use it for a diagnosis window, not for a whole run.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

#: phase name -> metric name (seconds per step)
PHASE_METRICS = {"data": "data_wait", "forward_backward": "fwd_bwd_time",
                 "optimizer": "optimizer_time", "comm": "comm_time"}


class StepTimer:
    """Accumulates phase times within a step; `step()` closes the step and reports.

    report_every: average over this many steps per report (fewer events for fast loops).
    sync: synchronise CUDA at phase boundaries (None: when CUDA is initialised in this process).
    """

    def __init__(self, report_every: int = 1, sync: bool | None = None) -> None:
        if isinstance(report_every, bool) or not isinstance(report_every, int) or report_every < 1:
            raise ValueError(f"StepTimer.report_every: got {report_every!r}; accepted: an int >= 1")
        self.report_every = report_every
        self._sync = sync
        self._phases: dict[str, float] = {}
        self._acc: dict[str, float] = {}
        self._acc_steps = 0
        self._acc_samples = 0
        self._last = time.perf_counter()
        self.last: dict[str, float] = {}  # the last metrics reported

    def _maybe_sync(self) -> None:
        if self._sync is False:
            return
        import sys

        torch = sys.modules.get("torch")
        # never initialise CUDA here: only where this process already uses it
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASE_METRICS:
            raise ValueError(f"StepTimer.phase: got {name!r}; accepted: "
                             f"{', '.join(map(repr, PHASE_METRICS))}")
        self._maybe_sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._maybe_sync()
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def restart(self) -> None:
        """Start the clock of the next step now (e.g. after an evaluation pause)."""
        self._last = time.perf_counter()
        self._phases.clear()

    def step(self, step: int | None = None, samples: int = 0, report: bool = True,
             **extra: float) -> dict[str, float] | None:
        """Close one step. Every `report_every` steps, report the averages (and `extra` scalars)
        through gpu_lab.report and return them; otherwise return None."""
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self._acc["step_time"] = self._acc.get("step_time", 0.0) + dt
        for name, metric in PHASE_METRICS.items():
            if name in self._phases:
                self._acc[metric] = self._acc.get(metric, 0.0) + self._phases[name]
        self._phases.clear()
        self._acc_steps += 1
        self._acc_samples += samples
        if self._acc_steps < self.report_every:
            return None
        n = self._acc_steps
        metrics = {k: v / n for k, v in self._acc.items()}
        if self._acc_samples and self._acc["step_time"] > 0:
            metrics["samples_per_s"] = self._acc_samples / self._acc["step_time"]
        metrics.update(extra)
        self._acc.clear()
        self._acc_steps = self._acc_samples = 0
        self.last = metrics
        if report:
            from ..record import report as _report

            _report(step, **metrics)
        return metrics


__all__ = ["StepTimer", "PHASE_METRICS"]
