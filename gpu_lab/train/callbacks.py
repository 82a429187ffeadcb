"""Callbacks: the only link between the fit loop and everything else (guards, profilers, logging).

The loop calls the hooks below at fixed points, on every rank, in the order the callbacks were
given. Every hook is a documented no-op here, so a callback overrides only what it needs. A hook
talks back to the loop only through the TrainState: `state.request("checkpoint")`,
`state.request("stop")`, … Requests are local; the loop makes all ranks agree on them (one small
all-reduce) before acting, so no rank is left waiting in a collective. That happens at logging
steps (every `log_every` steps, by default every step), where the loop reads the loss anyway —
the one CPU-GPU sync point per logging step; a request made in between waits for the next one.

Order of calls in fit():

    on_fit_start
    ┌ for each optimizer step:
    │   on_step_start
    │   (micro-batches: forward, backward; optimizer step)
    │   on_step_end
    │   on_log                 (every log_every steps, with the reported scalars)
    │   (requests agreed on across ranks and acted on: checkpoint, stop, preemption exit, …)
    │   on_checkpoint          (after a checkpoint was written)
    │   on_eval_end            (after an evaluation)
    └
    on_fit_end                 (also after a stop or a preemption, before the exit)
    on_exception               (an exception is leaving fit(); re-raised afterwards)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

#: Requests a callback can make; the loop agrees on them across ranks at each step boundary.
REQUESTS = ("checkpoint", "stop", "preempt", "memory", "nonfinite")


@dataclass
class TrainState:
    """What the loop knows; callbacks read it and make requests through `request()`."""

    config: Any
    accelerator: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    step: int = 0                 # optimizer steps done
    total_steps: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0       # micro-batches consumed in this epoch (the data position)
    samples_seen: int = 0         # samples over all ranks
    micro_batch_size: int = 0     # per device, after any OOM retry
    grad_accum_steps: int = 1
    loss: Any = None              # last micro-batch loss (a tensor: .item() is a sync point)
    lr: float = 0.0
    output_dir: Path | None = None
    last_checkpoint: Path | None = None
    metrics: dict = field(default_factory=dict)
    requests: set = field(default_factory=set)

    is_main_process: bool = True  # rank 0 (set once by fit: accelerate's property is not free)
    rank: int = 0

    def request(self, what: str) -> None:
        if what not in REQUESTS:
            raise ValueError(f"TrainState.request: got {what!r}; accepted: {', '.join(REQUESTS)}")
        self.requests.add(what)


class Callback:
    """Base class; every hook is a no-op. Hooks run on every rank."""

    def on_fit_start(self, state: TrainState) -> None:
        """After model, optimizer and data are prepared and any checkpoint is restored."""

    def on_step_start(self, state: TrainState) -> None:
        """Before the first micro-batch of optimizer step `state.step + 1`."""

    def on_step_end(self, state: TrainState) -> None:
        """After optimizer step `state.step` (already counted)."""

    def on_log(self, state: TrainState, metrics: dict[str, float]) -> None:
        """Every `log_every` steps, with the scalars just reported."""

    def on_eval_end(self, state: TrainState, metrics: dict[str, float]) -> None:
        """After an evaluation (accuracy and loss over the whole eval set, all ranks)."""

    def on_checkpoint(self, state: TrainState, path: Path, reason: str) -> None:
        """After a checkpoint was completely written at `path`."""

    def on_fit_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        """At the end of fit(), also after a stop or a preemption; `summary` is what fit returns."""

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        """An exception is leaving fit() (it is re-raised after the callbacks ran)."""


class CallbackList:
    """Calls a hook on every callback in order; a list with no overridden hook costs one loop."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks: got {type(cb).__name__}; accepted: instances of "
                                "gpu_lab.train.Callback")
        # per hook, only the callbacks that override it (keeps the per-step cost flat)
        self._active = {name: [getattr(cb, name) for cb in self.callbacks
                               if getattr(type(cb), name) is not getattr(Callback, name)]
                        for name in ("on_fit_start", "on_step_start", "on_step_end", "on_log",
                                     "on_eval_end", "on_checkpoint", "on_fit_end", "on_exception")}

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for fn in self._active[hook]:
            fn(*args)


__all__ = ["Callback", "CallbackList", "TrainState", "REQUESTS"]
