"""What a rank that gpu_lab started sets up before the user's code runs, so that code written for
`accelerate launch` or torchrun joins the run unchanged (RankEntry and gpu_lab.rank.headless call
`prepare()`):

- **accelerate forms the launch's group.** On a host without GPUs a bare `Accelerator()` is
  `DistributedType.NO` unless accelerate's CPU switch (`ACCELERATE_USE_CPU`) is set, and then
  every rank trains its own copy; it is set here, and `PartialState()` honours it too (accelerate
  reads it in `Accelerator` only). A rank whose accelerate state counts another number of
  processes than the launch started raises, naming both, instead of training alone.
- **`accelerator.log` reaches the record.** Every Accelerator of rank 0 gets gpu_lab's tracker
  (gpu_lab.rank.tracker), whatever `log_with` says and whether or not `init_trackers` is called:
  accelerate offers no hook for adding one unasked (`"all"` is a fixed list), so its `__init__`
  is wrapped in this process. `log_with="gpu_lab"` and `log_with=gpu_lab.Tracker()` name the
  same one.
- **Trainer and Lightning record too.** When `transformers.trainer`, Lightning's Trainer or
  Fabric is imported in the rank (gpu_lab.rank.imports: at import, not before, for code that
  never uses them), each Trainer gets gpu_lab's callback or logger (gpu_lab.rank.hf_trainer,
  gpu_lab.rank.lightning_logger) and continues from the checkpoint run.resume() chose.
- **A rank is not interactive.** A fork of IPython inherits `sys.ps1`, and Lightning then refuses
  `strategy="ddp"`: it is removed.
- **Tensors follow the model, on request.** With GPU_LAB_STRICT_DEVICE=1 a CPU rank refuses an
  operation that mixes a tensor on the accelerator's device with one left on the CPU, as a GPU
  would (gpu_lab.rank.devicecheck).
- **Ranks do not start ranks.** `torch.multiprocessing.spawn` / `start_processes` (Lightning's
  `ddp_spawn`, `ddp_notebook`) and accelerate's `notebook_launcher` raise with advice: gpu_lab
  has started the ranks already, and N more in each would fight over the same devices.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..record import events as ev
from .imports import DONE as _DONE
from .imports import when_imported, wrap

CPU_SWITCH = "ACCELERATE_USE_CPU"
# what a launched rank patches when the code imports it: module -> hook
FRAMEWORKS = {"transformers.trainer": "gpu_lab.rank.hf_trainer:adopt",
              "lightning.pytorch.trainer.trainer": "gpu_lab.rank.lightning_logger:adopt_trainer",
              "pytorch_lightning.trainer.trainer": "gpu_lab.rank.lightning_logger:adopt_trainer",
              "lightning.fabric.fabric": "gpu_lab.rank.lightning_logger:adopt_fabric",
              "lightning_fabric.fabric": "gpu_lab.rank.lightning_logger:adopt_fabric"}


class WorldSizeMismatch(RuntimeError):
    """accelerate's state counts another number of processes than the launch started."""


class RanksInRanks(RuntimeError):
    """Code in a launched rank tried to start ranks of its own."""


def prepare() -> None:
    """Set this rank up for the code users bring. Cheap where accelerate is loaded already (a
    forked rank); a fresh interpreter (a headless rank) imports it here."""
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    for mod in [m for n, m in list(sys.modules.items())
                if n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")]:
        if getattr(mod, "_IS_INTERACTIVE", False) is True:  # read at its import, in the kernel
            mod._IS_INTERACTIVE = False
    from .accelerator import device_kind

    if device_kind() == "cpu":  # the launch's word, else NVML's (a Slurm job's CPU ranks)
        os.environ.setdefault(CPU_SWITCH, "true")
    from .devicecheck import install

    install()  # GPU_LAB_STRICT_DEVICE=1: a CPU rank refuses what a GPU would (devicecheck.py)
    if os.environ.get(ev.ENV_ADDRESS):  # a rank of a run gpu_lab records
        for module, hook in FRAMEWORKS.items():
            when_imported(module, hook)
    try:
        import accelerate  # noqa: F401 - the patches below need it loaded
    except ImportError:  # code that does not use accelerate
        return
    _wrap_accelerate()
    _refuse_own_ranks()


def launch_world_size() -> int:
    """How many ranks the launch started (torch elastic's and srun's WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError:
        return 1


def check_world(state: Any, what: str) -> None:
    """Raise WorldSizeMismatch where accelerate's state counts another number of processes."""
    want, got = launch_world_size(), getattr(state, "num_processes", None)
    if got is None or got == want:
        return
    kind = getattr(state, "distributed_type", "?")
    raise WorldSizeMismatch(
        f"{what} sees {got} process(es) ({kind}), but gpu_lab started {want} ranks: each rank "
        f"would train a copy of its own. gpu_lab sets {CPU_SWITCH}=true in every rank of a run "
        "without GPUs so that accelerate forms the group (MULTI_CPU, gloo); this code's "
        f"environment no longer had it ({CPU_SWITCH}={os.environ.get(CPU_SWITCH)!r}), or it "
        "changed WORLD_SIZE/LOCAL_RANK. Leave them as the launch set them, or launch with "
        f"num_processes={got}")


def _wrap_accelerate() -> None:
    from accelerate.accelerator import Accelerator
    from accelerate.state import PartialState

    def partial_state(init: Callable) -> Callable:
        def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:
            if os.environ.get(CPU_SWITCH, "").lower() in ("1", "true", "yes"):
                cpu = True  # what Accelerator() does with the switch; PartialState() does not
            init(self, cpu, **kwargs)
            check_world(self, "accelerate")
        return __init__

    def accelerator(init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            check_world(self, "Accelerator()")
            if os.environ.get(ev.ENV_ADDRESS):
                report_used(self)
                if self.is_main_process:
                    _add_tracker(self)
        return __init__

    wrap(PartialState, "__init__", partial_state)
    wrap(Accelerator, "__init__", accelerator)
    from . import tracker  # noqa: F401 - registers the name "gpu_lab" where accelerate can


def used(acc: Any, sharding: str | None = None) -> dict[str, str]:
    """What an Accelerator really trains with: its mixed precision, distributed type and
    sharding (FSDP and its version, DeepSpeed's stage; `sharding` names one made without
    accelerate, such as fit()'s ZeRO-1)."""
    state = getattr(acc, "state", None)
    kind = getattr(acc.distributed_type, "value", str(acc.distributed_type))
    if sharding is None:
        sharding = "none"
        if kind == "FSDP":
            sharding = f"fsdp{getattr(getattr(state, 'fsdp_plugin', None), 'fsdp_version', 1)}"
        elif kind == "DEEPSPEED":
            stage = getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", "?")
            sharding = f"deepspeed stage {stage}"
    return {"mixed_precision": str(acc.mixed_precision), "distributed_type": kind,
            "sharding": sharding}


def report_used(acc: Any, sharding: str | None = None) -> None:
    """Tell the run's record what this rank's Accelerator uses (the run view and runs() show it:
    what the ranks used, not only what was asked)."""
    from ..record.reporter import get_reporter

    try:
        get_reporter().status("running", accelerate=used(acc, sharding))
    except Exception:  # noqa: BLE001 - a record that cannot take it must not stop the training
        pass


def _add_tracker(acc: Any) -> None:
    """gpu_lab's tracker among acc.trackers from the start (so that log() reaches it without
    init_trackers), and out of log_with (so that init_trackers does not add a second)."""
    from .tracker import Tracker

    named = [t for t in acc.log_with if isinstance(t, Tracker) or str(t) == Tracker.name]
    acc.log_with = [t for t in acc.log_with if t not in named]
    mine = next((t for t in named if isinstance(t, Tracker)), None) or Tracker()
    if not any(t is mine for t in acc.trackers):
        acc.trackers.append(mine)


def without_tracker(acc: Any) -> None:
    """Take gpu_lab's tracker off `acc`: for code that reports through gpu_lab.report already
    (gpu_lab.train.fit), whose accelerator.log would record every metric twice."""
    from .tracker import Tracker

    acc.trackers = [t for t in acc.trackers if not isinstance(t, Tracker)]


def _refuse_own_ranks() -> None:
    import torch.multiprocessing as tmp

    import accelerate
    import accelerate.launchers as launchers

    advice = ("Run the training itself here: gpu_lab started this process as rank "
              f"{os.environ.get('RANK', '0')} of {launch_world_size()} already (choose the number "
              "with launch(..., num_processes=N)); call the function that would be started in "
              "each rank directly, and with Lightning use strategy='ddp'.")
    targets = [(tmp, "spawn", "torch.multiprocessing.spawn"),
               (tmp, "start_processes", "torch.multiprocessing.start_processes "
                                        "(Lightning's ddp_spawn and ddp_notebook use it)"),
               (accelerate, "notebook_launcher", "accelerate.notebook_launcher"),
               (launchers, "notebook_launcher", "accelerate.notebook_launcher"),
               (accelerate, "debug_launcher", "accelerate.debug_launcher"),
               (launchers, "debug_launcher", "accelerate.debug_launcher")]
    for module, attr, label in targets:
        if getattr(getattr(module, attr, None), _DONE, False):
            continue

        def refused(*args: Any, _label: str = label, **kwargs: Any) -> None:
            raise RanksInRanks(f"{_label} was called in a rank that gpu_lab launched: it would "
                               f"start ranks of its own. {advice}")
        setattr(refused, _DONE, True)
        setattr(module, attr, refused)
