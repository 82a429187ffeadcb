"""A Hugging Face Trainer records into gpu_lab: `gpu_lab.TrainerCallback`.

What the Trainer logs (loss, learning rate, grad norm, eval metrics) goes into the record at its
global step, its TrainingArguments become the run's config, and each checkpoint-N folder it saves
is listed on the run (Run.checkpoints), so that `run.resume()` continues from the newest.

In ranks gpu_lab launched nobody has to name it: when `transformers.trainer` is imported there
(gpu_lab.rank.adopt), every Trainer gets the callback in its `__init__`, and a `train()` that
names no checkpoint continues from the one run.resume() chose. Trainer's `report_to` accepts
only the names in transformers' own table: importing this module adds "gpu_lab" to it, so
`report_to=["gpu_lab"]` works too; anywhere else pass `callbacks=[gpu_lab.TrainerCallback()]`.
Outside a run gpu_lab started (`accelerate launch train.py`, torchrun), the callback records the
run itself, as gpu_lab.Tracker does.
"""
from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback as _Base

from ..record import events as ev
from .imports import wrap
from .tracker import Tracker


class TrainerCallback(_Base):
    """transformers' TrainerCallback for gpu_lab's record (world process zero records)."""

    def __init__(self, run_name: str | None = None) -> None:
        self.tracker = Tracker(run_name)
        self._configured = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and not self._configured:
            self._configured = True
            self.tracker.store_init_configuration(args.to_dict())

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            self.tracker.log(dict(logs), step=state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.tracker.checkpoint(path, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:  # a run of its own ends at exit: evaluate() may follow
            self.tracker.flush()

    def __repr__(self) -> str:
        return "gpu_lab.TrainerCallback()"


def _register() -> None:
    """report_to=["gpu_lab"] names this callback."""
    try:
        from transformers.integrations import integration_utils as iu
    except ImportError:  # pragma: no cover - a transformers without the table
        return
    iu.INTEGRATION_TO_CALLBACK.setdefault(Tracker.name, TrainerCallback)


def adopt(module: Any) -> None:
    """In a launched rank, once transformers.trainer is imported: every Trainer records here,
    and continues from the checkpoint run.resume() chose when its train() names none."""
    trainer = module.Trainer

    def init(orig: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if not any(isinstance(c, TrainerCallback) for c in
                       self.callback_handler.callbacks):
                self.add_callback(TrainerCallback())
        return __init__

    def train(orig: Any) -> Any:
        def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            chosen = os.environ.get(ev.ENV_RESUME)
            if resume_from_checkpoint is None and chosen and os.path.isdir(chosen):
                resume_from_checkpoint = chosen
                if self.is_world_process_zero():
                    from ..record import reporter as rep

                    rep.get_reporter().log(f"the Trainer continues from {chosen} (run.resume())")
            return orig(self, resume_from_checkpoint, *args, **kwargs)
        return train

    wrap(trainer, "__init__", init)
    wrap(trainer, "train", train)
    _rank_device(module.TrainingArguments)


def _rank_device(cls: Any) -> None:
    """TrainingArguments.device names the rank's device: accelerate's device object wherever the
    two are equal. With one process transformers makes a device of its own ("cuda:0" on a GPU,
    where it is accelerate's device too; "cpu" on a CPU rank), and on a CPU rank that checks
    devices (GPU_LAB_STRICT_DEVICE, gpu_lab.rank.devicecheck) a fresh "cpu" names the host's CPU,
    not the rank's device: the Trainer's batches, moved there, would meet a model that accelerate
    put on the rank's device, and a script that runs on a one-GPU server would be refused."""
    from .imports import DONE

    prop = cls.__dict__.get("device")
    if not isinstance(prop, property) or getattr(prop.fget, DONE, False):
        return

    def device(self: Any) -> Any:
        from .devicecheck import _accelerate_device

        own, acc = prop.fget(self), _accelerate_device()
        return acc if acc is not None and acc == own else own

    setattr(device, DONE, True)
    cls.device = property(device, doc=prop.__doc__)


_register()
