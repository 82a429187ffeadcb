"""A torch.profiler window over a few optimizer steps: where the compute time goes, as Nsight
Systems would show it, from inside the process.

The trace lands in `<output_dir>/profile/rank<r>.<ns>.pt.trace.json`, Chrome trace format: open it
at https://ui.perfetto.dev (drag and drop) or chrome://tracing, or point TensorBoard's profile
plugin at the directory. Outside the window the profiler is off, so it costs nothing.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .callbacks import Callback, TrainState

log = logging.getLogger(__name__)


class ProfilerWindow(Callback):
    """Profile `steps` optimizer steps after skipping the first one (lazy init and allocator
    warm-up would dominate it) and one warm-up step, where the run is long enough."""

    def __init__(self, steps: int, out_dir: str | Path | None = None, record_shapes: bool = True,
                 profile_memory: bool = True) -> None:
        if steps < 1:
            raise ValueError(f"ProfilerWindow.steps: got {steps!r}; accepted: an int >= 1")
        self.steps = int(steps)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.record_shapes, self.profile_memory = record_shapes, profile_memory
        self._prof = None
        self._left = 0
        self.traces: list[Path] = []

    def on_fit_start(self, state: TrainState) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        out = self.out_dir or Path(state.output_dir or ".") / "profile"
        out.mkdir(parents=True, exist_ok=True)
        self.out_dir = out
        remaining = max(0, state.total_steps - state.step)
        skip = 1 if remaining >= self.steps + 2 else 0
        warmup = 1 if remaining >= self.steps + skip + 1 else 0
        activities = [ProfilerActivity.CPU]
        if state.accelerator is not None and state.accelerator.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._before = set(out.glob("*.pt.trace.json"))
        self._prof = profile(activities=activities,
                             schedule=schedule(skip_first=skip, wait=0, warmup=warmup,
                                               active=self.steps, repeat=1),
                             on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{state.rank}"),
                             record_shapes=self.record_shapes, profile_memory=self.profile_memory)
        self._left = skip + warmup + self.steps
        self._prof.start()

    def on_step_end(self, state: TrainState) -> None:
        if self._prof is None:
            return
        self._prof.step()
        self._left -= 1
        if self._left <= 0:
            self._stop()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        self.traces = sorted(set(self.out_dir.glob("*.pt.trace.json")) - self._before)
        if self.traces:
            log.info("profiler trace: %s (open at https://ui.perfetto.dev)", self.traces[-1])

    def on_fit_end(self, state: TrainState, summary: dict) -> None:
        self._stop()
        if self.traces:
            summary["profile_trace"] = str(self.traces[-1])

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self._stop()


__all__ = ["ProfilerWindow"]
