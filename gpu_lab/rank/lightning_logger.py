"""Lightning's Trainer and Fabric record into gpu_lab: `gpu_lab.LightningLogger`.

One logger serves both (Lightning's Trainer logger is a Fabric logger): `log_metrics` goes into
the record at its step, `log_hyperparams` becomes the run's config, and each checkpoint the
Trainer's ModelCheckpoint (or `fabric.save`) writes is listed on the run (Run.checkpoints), so
that `run.resume()` continues from the newest. Rank 0 records, as Lightning's own loggers do.

In ranks gpu_lab launched nobody has to name it: when Lightning's Trainer or Fabric is imported
there (gpu_lab.rank.adopt), each one gets the logger beside those it was given (`logger=False`
too: the record is gpu_lab's, not a logger of the user's), and a `fit()` that names no ckpt_path
continues from the one run.resume() chose. Anywhere else: `Trainer(logger=gpu_lab.LightningLogger())`
or `Fabric(loggers=[gpu_lab.LightningLogger()])`; outside a run gpu_lab started it records the
run itself, as gpu_lab.Tracker does. Both package names work (`lightning`, `pytorch_lightning` /
`lightning_fabric`): the class is made for the one the code imports.
"""
from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from ..record import events as ev
from .imports import wrap
from .tracker import Tracker

PUBLIC = "lightning.pytorch.loggers"  # gpu_lab.LightningLogger's base
_classes: dict[str, type] = {}


def logger_class(base_module: str = PUBLIC) -> type:
    """gpu_lab's logger on the Logger of `base_module` (a Lightning or Fabric loggers module)."""
    if base_module in _classes:
        return _classes[base_module]
    base = importlib.import_module(base_module).Logger
    top = base_module.split(".")[0]
    fabric = "lightning.fabric" if top == "lightning" else "lightning_fabric"
    zero = importlib.import_module(f"{fabric}.utilities.rank_zero").rank_zero_only

    class LightningLogger(base):  # type: ignore[misc, valid-type]
        """Lightning's Logger for gpu_lab's record: rank 0's metrics, hyperparameters and
        checkpoints. For `Trainer(logger=...)` and `Fabric(loggers=[...])`."""

        def __init__(self, run_name: str | None = None) -> None:
            super().__init__()
            self.tracker = Tracker(run_name)

        @staticmethod
        def _zero() -> bool:
            return getattr(zero, "rank", 0) == 0

        @property
        def name(self) -> str:
            return Tracker.name

        @property
        def version(self) -> str:
            return os.environ.get(ev.ENV_RUN_ID, "")

        @property
        def experiment(self) -> Any:
            return self.tracker.tracker

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            if self._zero():
                self.tracker.store_init_configuration(params)

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            if self._zero():
                self.tracker.log(dict(metrics), step=step)

        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            cb = checkpoint_callback
            path = (getattr(cb, "_last_checkpoint_saved", "") or getattr(cb, "last_model_path", "")
                    or getattr(cb, "best_model_path", ""))
            if self._zero() and path:
                self.tracker.checkpoint(path, getattr(cb, "_last_global_step_saved", None))

        def save(self) -> None:
            pass

        def finalize(self, status: str) -> None:
            if self._zero():  # a run of its own ends at exit (failed after an exception)
                self.tracker.flush()

        def __repr__(self) -> str:
            return "gpu_lab.LightningLogger()"

    LightningLogger.__module__ = __name__
    _classes[base_module] = LightningLogger
    return LightningLogger


try:  # `import lightning` loads lightning.pytorch anyway: no cost to a Fabric script
    LightningLogger = logger_class(PUBLIC)
except ImportError:  # only the pytorch_lightning package: its class is made at its import
    LightningLogger = None  # type: ignore[assignment, misc]


def _ours(loggers: Any) -> bool:
    return any(getattr(type(x), "__module__", "") == __name__ for x in loggers or ())


def _resume_to(orig: Any, name: str) -> Any:
    """A wrapper of `orig` whose argument `name`, when None, becomes run.resume()'s choice."""
    sig = inspect.signature(orig)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = os.environ.get(ev.ENV_RESUME)
        if chosen and os.path.exists(chosen):
            bound = sig.bind_partial(self, *args, **kwargs)
            if bound.arguments.get(name) is None:
                bound.arguments[name] = chosen
                args, kwargs = bound.args[1:], bound.kwargs
        return orig(self, *args, **kwargs)
    return call


def adopt_trainer(module: Any) -> None:
    """In a launched rank, once Lightning's Trainer is imported: every Trainer records here."""
    top = module.__name__.split(".")[0]
    cls = logger_class("lightning.pytorch.loggers" if top == "lightning"
                       else "pytorch_lightning.loggers")

    def init(orig: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if not _ours(self.loggers):
                self.loggers = [*self.loggers, cls()]
        return __init__

    wrap(module.Trainer, "__init__", init)
    wrap(module.Trainer, "fit", lambda orig: _resume_to(orig, "ckpt_path"))


def adopt_fabric(module: Any) -> None:
    """In a launched rank, once Fabric is imported: every Fabric records here, and what
    fabric.save() writes is listed on the run."""
    top = module.__name__.split(".")[0]
    cls = logger_class("lightning.fabric.loggers" if top == "lightning"
                       else "lightning_fabric.loggers")

    def init(orig: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if not _ours(self._loggers):
                self._loggers.append(cls())
        return __init__

    def save(orig: Any) -> Any:
        def save(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, path, *args, **kwargs)
            for logger in self._loggers:
                if getattr(type(logger), "__module__", "") == __name__ and logger._zero():
                    logger.tracker.checkpoint(path)
            return out
        return save

    wrap(module.Fabric, "__init__", init)
    wrap(module.Fabric, "save", save)
