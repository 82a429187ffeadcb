"""Guards: callbacks that keep a run from losing work to a preempted spot instance, a full GPU or a NaN.

- PreemptionGuard: SIGTERM / SIGUSR1 / SIGHUP set a flag; the ranks agree at the next step boundary, save a
  checkpoint and leave with exit code 143 (128 + SIGTERM, what schedulers expect).
- ControlRequests: the kernel's "Checkpoint now" / "Stop" buttons (a file per request, a stat()
  per step on rank 0).
- MemoryGuard: GPU memory ≥ threshold → one checkpoint and one memory snapshot per run.
- NonFiniteLossGuard: a NaN/inf loss stops the run before it overwrites a good checkpoint.

Signal handlers only set a flag: saving from inside a handler could interrupt a collective or a
half-written file. Data loader workers ignore these signals (see data.py), so a SIGTERM sent to the
whole process group does not kill them under the loop's feet.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

# the public names of the one exit code and set of stop signals (gpu_lab.rank.outcome)
from ..rank.outcome import STOP_EXIT_CODE as PREEMPT_EXIT_CODE, STOP_SIGNALS as PREEMPT_SIGNALS
from .callbacks import Callback, TrainState

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised by fit() on every rank after the preemption checkpoint; exits the process with 143."""

    def __init__(self, step: int, checkpoint: str | None, signum: int | None) -> None:
        super().__init__(PREEMPT_EXIT_CODE)
        self.step, self.checkpoint, self.signum = step, checkpoint, signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "a preemption request"
        return (f"preempted by {name} at step {self.step}; checkpoint {self.checkpoint} "
                f"(exit code {PREEMPT_EXIT_CODE}); relaunch with resume=True to continue")


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


class PreemptionGuard(Callback):
    """Turn SIGTERM / SIGUSR1 / SIGHUP into "checkpoint at the next step boundary, then exit 143"."""

    def __init__(self, signals: tuple[int, ...] = PREEMPT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:  # only sets a flag: async-signal safe
        self.received = signum

    def on_fit_start(self, state: TrainState) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionGuard: fit() is not on the main thread; signals cannot be caught "
                        "here (run it through gpu_lab.launch, notebook_launcher or torchrun)")
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
            # restart interrupted system calls (a gloo/NCCL wait, a file read) instead of failing
            # them with EINTR: the handler only sets a flag, nothing needs to be interrupted
            signal.siginterrupt(s, False)

    def on_step_end(self, state: TrainState) -> None:
        if self.received is not None:
            state.request("preempt")

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def on_fit_end(self, state: TrainState, summary: dict) -> None:
        self._restore()

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self._restore()


class ControlRequests(Callback):
    """The kernel's Run.request_checkpoint() / stop requests, read on rank 0 at step boundaries.

    A request is a file in the run directory's control/ folder (see gpu_lab.rank.accelerator); looking
    for it is one stat() per name and step. Outside a gpu_lab launch there is no run directory and
    this does nothing. `poll(name, consume)` replaces the file check (tests, other launchers).
    """

    def __init__(self, poll: Callable[[str, bool], bool] | None = None) -> None:
        self.poll = poll
        self._active = False

    def on_fit_start(self, state: TrainState) -> None:
        from ..rank.accelerator import control_dir, control_requested

        # decided once: rank 0 of a launch (or a custom poll) looks; every other case costs nothing
        self._active = state.is_main_process and (self.poll is not None or control_dir() is not None)
        if self.poll is None:
            self.poll = control_requested

    def on_step_end(self, state: TrainState) -> None:
        if not self._active:
            return
        if self.poll("checkpoint", True):
            state.request("checkpoint")
        # not consumed: the supervisor reads the same file to report the run as "stopped"
        if self.poll("stop", False):
            state.request("stop")


def cuda_memory_fraction(device) -> float:
    """Used fraction of the GPU's memory, all processes included (what nvidia-smi shows)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return 1.0 - free / total


class MemoryGuard(Callback):
    """Once memory use reaches `threshold`, request one checkpoint and write a memory snapshot.

    `probe()` returns the used fraction or None (unknown). By default it reads the GPU through
    torch.cuda.mem_get_info inside the worker, and on a CPU-only run there is nothing to read, so
    the guard does nothing; tests pass a probe of their own.
    """

    def __init__(self, threshold: float = 0.95, probe: Callable[[], float | None] | None = None,
                 every: int = 1) -> None:
        self.threshold, self.probe, self.every = threshold, probe, max(1, int(every))
        self.fired = False
        self.fraction: float | None = None
        self.snapshots: list[Path] = []

    def on_fit_start(self, state: TrainState) -> None:
        if self.probe is None and state.accelerator is not None and state.accelerator.device.type == "cuda":
            device = state.accelerator.device
            self.probe = lambda: cuda_memory_fraction(device)

    def on_step_end(self, state: TrainState) -> None:
        if self.fired or self.probe is None or state.step % self.every:
            return
        frac = self.probe()
        if frac is not None and frac >= self.threshold:
            self.fraction = float(frac)
            state.request("memory")

    def on_checkpoint(self, state: TrainState, path: Path, reason: str) -> None:
        if reason == "memory" and not self.fired:
            self.fired = True
            self.snapshots.append(self.snapshot(state))

    def snapshot(self, state: TrainState) -> Path:
        """Write this rank's memory snapshot under output_dir/memory/ and return its path: a JSON
        summary, plus on CUDA the allocator snapshot that https://pytorch.org/memory_viz opens."""
        out = Path(state.output_dir or ".") / "memory"
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"step_{state.step:09d}_rank{state.rank}"
        info = {"step": state.step, "rank": state.rank, "threshold": self.threshold,
                "fraction": self.fraction, "time": time.time(),
                "micro_batch_size": state.micro_batch_size}
        try:
            import psutil

            info["host_rss_bytes"] = psutil.Process().memory_info().rss
        except ImportError:  # pragma: no cover - psutil is a dependency
            pass
        acc = state.accelerator
        if acc is not None and acc.device.type == "cuda":
            import torch

            info["memory_stats"] = {k: v for k, v in torch.cuda.memory_stats(acc.device).items()
                                    if k.endswith(("current", "peak")) and k.startswith(("allocated_bytes.all", "reserved_bytes.all"))}
            info["summary"] = torch.cuda.memory_summary(acc.device)
            torch.cuda.memory._dump_snapshot(str(stem) + ".pickle")
            info["allocator_snapshot"] = str(stem) + ".pickle"
        path = Path(str(stem) + ".json")
        path.write_text(json.dumps(info, indent=1, default=str))
        log.warning("memory at %.1f%% ≥ %.0f%%: checkpoint saved, snapshot in %s",
                    100 * (self.fraction or 0), 100 * self.threshold, path)
        return path


class NonFiniteLossGuard(Callback):
    """Request a stop when the reported loss is NaN or inf (checked where the loop already synced
    to read the loss: every log step)."""

    def __init__(self) -> None:
        self.bad_step: int | None = None
        self.bad_value: float | None = None

    def on_log(self, state: TrainState, metrics: dict) -> None:
        v = metrics.get("loss")
        if v is not None and not math.isfinite(v):
            self.bad_step, self.bad_value = state.step, v
            state.request("nonfinite")


def default_guards(config) -> list[Callback]:
    """The guards fit() adds unless told otherwise: all are cheap per step."""
    return [PreemptionGuard(), ControlRequests(), MemoryGuard(config.memory_threshold,
            every=config.log_every), NonFiniteLossGuard()]


__all__ = ["PreemptionGuard", "ControlRequests", "MemoryGuard", "NonFiniteLossGuard", "Preempted",
           "NonFiniteLossError", "PREEMPT_EXIT_CODE", "default_guards", "cuda_memory_fraction"]
