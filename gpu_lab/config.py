"""TrainConfig: the validated configuration of one training run.

It takes the keys a usual training config dict has (batch_size, num_epochs, lr, optimizer,
scheduler, gradient_accumulation_steps) and adds what a run on a GPU server needs. Every field carries help
text (the LaunchPanel form shows it), and a wrong value raises an error that names the field, the
value and what is accepted, before any process starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping


class StrEnum(str, Enum):
    """A string enum whose members compare equal to their values and list their choices."""

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value

    @classmethod
    def choices(cls) -> list[str]:
        return [m.value for m in cls]


class Optimizer(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


class Scheduler(StrEnum):
    COSINE = "cosine"
    CONSTANT = "constant"
    STEP = "step"


class MixedPrecision(StrEnum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"


class Augment(StrEnum):
    NONE = "none"
    BASIC = "basic"
    AUTOAUGMENT = "autoaugment"


class Sharding(StrEnum):
    NONE = "none"
    ZERO1 = "zero1"
    FSDP = "fsdp"


class Decode(StrEnum):
    CPU = "cpu"
    GPU = "gpu"
    AUTO = "auto"


#: Model names that gpu_lab.models.build accepts. The tiny ones learn in seconds on a CPU.
MODEL_NAMES = ("tiny_cnn", "tiny_resnet", "tiny_vit", "resnet18", "resnet50", "vgg16", "vit_b_16")

# Names used by other tools (common config dicts, accelerate, HF Trainer) → our field names.
ALIASES = {
    "num_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum_steps",
    "learning_rate": "lr",
    "precision": "mixed_precision",
    "nproc_per_node": "num_processes",
    "save_total_limit": "keep_last",
    "gpu_ids": "gpus",  # accelerate's config: "all" or "0,1"
}


def _f(default: Any, help: str, *, choices: type[StrEnum] | tuple | None = None,
       lo: float | None = None, hi: float | None = None, optional: bool = False,
       lo_open: bool = False, form: bool = True, path: bool = False,
       check: Any = None) -> Any:
    """A dataclass field with the metadata that validation and the form widget read. `path`: a
    file system path, never blank (an optional one may be left empty: None). `check(name,
    value)`: the validator of a field of several shapes (the form edits it as text)."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "optional": optional,
            "lo_open": lo_open, "form": form, "path": path, "check": check}
    return field(default=default, metadata=meta)


_GPUS_ACCEPTED = ("accepted: a count >= 1 (any free GPUs), a list of GPU indices such as "
                  "[0, 1] or '0,1', 'all', or empty (one GPU per process)")


def _check_gpus(name: str, value: Any) -> int | list[int] | str | None:
    """gpus as launch() takes it: N, [indices] or "all"; the form's text ("2", "0,1", "[0, 1]")
    is read into one of those. Whether this host has them is launch()'s check, not the config's
    (a config may be written for another machine)."""
    if isinstance(value, str):
        text = value.strip().strip("[]()").strip()
        if text.lower() == "all":
            return "all"
        if not text:
            return None
        try:
            parts = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"{name}: got {value!r}; {_GPUS_ACCEPTED}") from None
        value = parts[0] if len(parts) == 1 and "," not in text and "[" not in value else parts
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= 1024:
            raise ValueError(f"{name}: got {value}; {_GPUS_ACCEPTED}")
        return value
    if isinstance(value, (list, tuple)):
        idx = list(value)
        if not idx or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                              for i in idx):
            raise ValueError(f"{name}: got {value!r}; {_GPUS_ACCEPTED} (indices are whole "
                             f"numbers >= 0)")
        if len(set(idx)) != len(idx):
            raise ValueError(f"{name}: got {value!r}, which names a GPU twice; {_GPUS_ACCEPTED}")
        return idx
    raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); {_GPUS_ACCEPTED}")


@dataclass
class TrainConfig:
    """Configuration of one training run. All fields are validated on construction."""

    # --- what to train -------------------------------------------------------------------------
    model: str = _f("tiny_cnn", "Model to build with gpu_lab.models.build: tiny_* learn in seconds "
                    "on a CPU; resnet18/resnet50/vgg16/vit_b_16 are torchvision's, randomly initialised.",
                    choices=MODEL_NAMES)
    data_dir: str | None = _f(None, "ImageFolder or WebDataset shard directory. Empty: gpu_lab makes "
                              "a synthetic image set (no download).", optional=True, path=True)
    image_size: int = _f(32, "Input image side in pixels (larger shows finer detail for more compute).",
                         lo=8, hi=4096)
    num_classes: int = _f(10, "Number of classes.", lo=2, hi=100_000)
    # --- how long ------------------------------------------------------------------------------
    batch_size: int = _f(32, "Batch size per process (per GPU). The global batch is "
                         "batch_size × grad_accum_steps × num_processes.", lo=1, hi=65536)
    epochs: int | None = _f(1, "Passes over the training data; ignored when max_steps is set.",
                            lo=1, hi=100_000, optional=True)
    max_steps: int | None = _f(None, "Stop after this many optimizer steps (overrides epochs).",
                               lo=1, hi=10**9, optional=True)
    # --- optimisation --------------------------------------------------------------------------
    lr: float = _f(1e-3, "Peak learning rate (fine-tuning a pretrained model wants a small one, e.g. 3e-5).", lo=0.0, hi=10.0,
                   lo_open=True)
    optimizer: str = _f("adamw", "Optimizer: adamw (decoupled weight decay) or sgd (with momentum).",
                        choices=Optimizer)
    weight_decay: float = _f(0.01, "Weight decay.", lo=0.0, hi=1.0)
    momentum: float = _f(0.9, "SGD momentum (ignored by adamw).", lo=0.0, hi=1.0)
    scheduler: str = _f("cosine", "Learning-rate schedule: cosine (after warmup), "
                        "constant, or step.", choices=Scheduler)
    warmup_ratio: float = _f(0.05, "Fraction of steps with linear warmup (0.05: the first 5%).",
                             lo=0.0, hi=1.0)
    step_size: int = _f(1000, "Step schedule: multiply the lr by gamma every step_size steps.",
                        lo=1, hi=10**9)
    gamma: float = _f(0.1, "Step schedule: the factor applied every step_size steps.", lo=0.0, hi=1.0,
                      lo_open=True)
    grad_accum_steps: int = _f(1, "Micro-batches accumulated per optimizer step: a large global batch on little memory.",
                               lo=1, hi=4096)
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient norm to this value; empty: no "
                                     "clipping.", lo=0.0, hi=1e6, optional=True, lo_open=True)
    # --- precision, memory and speed -------------------------------------------------------------
    mixed_precision: str = _f("no", "Autocast precision: no (fp32), fp16 (GPU only, with loss "
                              "scaling) or bf16.", choices=MixedPrecision)
    activation_checkpointing: bool = _f(False, "Recompute activations in backward: less memory, "
                                        "more compute (about −40% activation memory for +25% time).")
    channels_last: bool = _f(False, "Use the channels_last memory format (faster convolutions on "
                             "Tensor Cores).")
    compile: bool = _f(False, "Compile the model with torch.compile (opt-in; slow first steps).")
    powersgd: bool = _f(False, "Compress DDP gradients with the PowerSGD communication hook.")
    zero: bool = _f(False, "Shard optimizer state across ranks (ZeroRedundancyOptimizer, ZeRO-1); "
                    "the same as sharding='zero1'.")
    sharding: str = _f("none", "What the ranks split between them: none (each holds the whole "
                       "model, DDP), zero1 (the optimizer state) or fsdp (parameters, gradients "
                       "and optimizer state, FSDP2): about 1/N of the model's memory on each of "
                       "N ranks. One rank has nothing to split.", choices=Sharding)
    offload: bool = _f(False, "With sharding='fsdp' on GPUs: keep the parameters and optimizer "
                       "state in CPU memory between uses (less GPU memory, slower steps).")
    # --- processes and data loading --------------------------------------------------------------
    num_processes: int | None = _f(None, "Processes (one per GPU). Empty: every GPU NVML reports, "
                                   "or 2 CPU processes on a host without a GPU.", lo=1, hi=1024,
                                   optional=True)
    gpus: str | None = _f(None, "GPUs the ranks see: a count (any free ones), indices such as "
                          "0,1, or all. Empty: one per process. GPUs other runs hold, of any "
                          "user of the host, are waited for (the run is queued).", optional=True,
                          check=_check_gpus)
    priority: int = _f(0, "Among your own queued runs, higher starts first (then the order of "
                       "launch); it never moves another user's runs back.", lo=-10**6, hi=10**6)
    num_workers: int = _f(2, "DataLoader worker processes per rank.", lo=0, hi=256)
    augment: str = _f("basic", "Augmentation: none, basic (crop + flip) or autoaugment (+ "
                      "RandomErasing).", choices=Augment)
    decode: str = _f("cpu", "Where shard images are decoded: cpu (in the DataLoader workers), "
                     "gpu (whole batches with nvJPEG on the training GPU, crop and flip there "
                     "too; JPEG shards, augment none or basic), or auto (gpu when the host has "
                     "one and the augmentation allows it).", choices=Decode)
    seed: int = _f(42, "Random seed for Python, NumPy, torch and data order.", lo=0, hi=2**32 - 1)
    # --- checkpoints, logging, guards ------------------------------------------------------------
    output_dir: str = _f("gpu_lab_runs", "Where checkpoints, TensorBoard logs and traces go. "
                         "gpu_lab.launch gives every run a folder of its own inside it.",
                         path=True)
    checkpoint_every: int = _f(0, "Save a checkpoint every N optimizer steps; 0: only at the end "
                               "and on preemption.", lo=0, hi=10**9)
    keep_last: int = _f(3, "How many complete checkpoints to keep.", lo=1, hi=10_000)
    resume: bool = _f(True, "Continue from the newest complete checkpoint in output_dir if there is "
                      "one: what a requeued batch job needs. A launched run starts in a new folder; "
                      "continue one with launch(..., resume=run) or run.resume().")
    resume_from: str | None = _f(None, "A checkpoint folder to continue from (set by "
                                 "launch(..., resume=...)); its model, num_classes, image_size, "
                                 "optimizer and zero must match this config.", optional=True,
                                 form=False)
    eval_every: int = _f(0, "Evaluate every N steps; 0: at the end of each epoch.", lo=0, hi=10**9)
    log_every: int = _f(1, "Report metrics every N optimizer steps.", lo=1, hi=10**6)
    tensorboard: bool = _f(True, "Log scalars to TensorBoard under output_dir.")
    memory_threshold: float = _f(0.95, "GPU memory fraction that triggers one checkpoint and a "
                                 "memory snapshot.", lo=0.0, hi=1.0,
                                 lo_open=True)
    oom_retry: bool = _f(False, "On out-of-memory, retry with half the per-device batch and twice the "
                         "accumulation, keeping the global batch.")
    profile_steps: int = _f(0, "Record a torch.profiler trace of this many steps; 0: off.",
                            lo=0, hi=10_000)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _validate_field(f, getattr(self, f.name)))
        self._check_gpus_and_processes()
        self._check_sharding()
        if self.max_steps is None and self.epochs is None:
            raise ValueError("TrainConfig.max_steps: got None while epochs is None too; accepted: "
                             "a positive max_steps, or a positive epochs")

    def _check_sharding(self) -> None:
        """zero=True and sharding='zero1' say the same: each sets the other."""
        if self.zero and self.sharding == Sharding.FSDP:
            raise ValueError("TrainConfig.zero: got True with sharding='fsdp'; accepted: one of "
                             "the two (fsdp shards the optimizer state too)")
        if self.zero:
            self.sharding = Sharding.ZERO1.value
        self.zero = self.sharding == Sharding.ZERO1
        if self.offload and self.sharding != Sharding.FSDP:
            raise ValueError(f"TrainConfig.offload: got True with sharding={self.sharding!r}; "
                             "accepted: offload with sharding='fsdp' (FSDP moves the parameters "
                             "to and from CPU memory)")

    def _check_gpus_and_processes(self) -> None:
        count = self.gpus if isinstance(self.gpus, int) else (
            len(self.gpus) if isinstance(self.gpus, list) else None)
        if count is not None and self.num_processes is not None and count != self.num_processes:
            raise ValueError(f"TrainConfig.gpus: got {self.gpus!r}, {count} GPU(s) for "
                             f"num_processes={self.num_processes}; accepted: one GPU per "
                             f"process, so {self.num_processes} GPU(s), or leave one of the two "
                             f"empty")

    # --- conversions ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """Build from a dict; other tools' names (num_epochs, gradient_accumulation_steps, …)
        are accepted, unknown keys are refused with the closest valid name."""
        if not isinstance(d, Mapping):
            raise TypeError(f"TrainConfig.from_dict: expected a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        kw: dict[str, Any] = {}
        for key, value in d.items():
            name = ALIASES.get(key, key)
            if name not in names:
                close = difflib.get_close_matches(str(key), names + list(ALIASES), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"TrainConfig: unknown field {key!r}.{hint} "
                                 f"Accepted fields: {', '.join(names)}.")
            if name in ("optimizer", "mixed_precision", "scheduler", "augment",
                        "sharding") and isinstance(value, str):
                value = value.lower()  # "AdamW" as torch spells it
            kw[name] = value
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str | bytes | Path) -> "TrainConfig":
        if isinstance(text, Path):
            text = text.read_text()
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_help(cls) -> dict[str, dict[str, Any]]:
        """Per-field help, type, default and choices (what the LaunchPanel form is generated from)."""
        out = {}
        for f in dataclasses.fields(cls):
            m = f.metadata
            choices = m["choices"]
            if isinstance(choices, type) and issubclass(choices, StrEnum):
                choices = tuple(choices.choices())
            out[f.name] = {"help": m["help"], "type": _base_type(f), "default": f.default,
                           "choices": choices, "lo": m["lo"], "hi": m["hi"],
                           "optional": m["optional"], "form": m["form"]}
        return out

    def total_steps(self, steps_per_epoch: int | None = None) -> int:
        """Optimizer steps the run will take (max_steps, or epochs × steps_per_epoch)."""
        if self.max_steps is not None:
            return self.max_steps
        if steps_per_epoch is None:
            raise ValueError("TrainConfig.total_steps: epochs is set, so steps_per_epoch is needed")
        return int(self.epochs) * int(steps_per_epoch)


# Fields that differ between runs by construction (each launched run has its own folder).
_PER_RUN = ("output_dir", "resume_from")


def config_diff(configs: list[Mapping[str, Any] | None]) -> list[str]:
    """The config fields whose values differ between these runs' configs (TrainConfig.to_dict()
    or registry rows' configs), in field order: what tells their curves apart in a legend."""
    dicts = [dict(c or {}) for c in configs]
    order = [f.name for f in dataclasses.fields(TrainConfig)]
    keys = sorted({k for d in dicts for k in d}, key=lambda k: (order.index(k) if k in order
                                                                else len(order), k))
    return [k for k in keys if k not in _PER_RUN
            and len({json.dumps(d.get(k), sort_keys=True, default=str) for d in dicts}) > 1]


def _base_type(f: dataclasses.Field) -> type:
    t = f.type if not isinstance(f.type, str) else f.type
    s = str(t)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if s.startswith(name):
            return typ
    raise AssertionError(f"unsupported field type {t!r}")  # pragma: no cover


def _validate_field(f: dataclasses.Field, value: Any) -> Any:
    name = f"TrainConfig.{f.name}"
    m = f.metadata
    typ = _base_type(f)
    if m.get("check") is not None and value is not None:
        return m["check"](name, value)
    if value is None or (m["optional"] and value == ""):
        if m["optional"]:
            return None
        raise TypeError(f"{name}: got None; expected {typ.__name__}")
    if typ is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected True or False")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected an int")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name}: got {value!r}; expected a finite number")
    elif typ is str:
        if isinstance(value, Enum):
            value = value.value
        if not isinstance(value, str):
            raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected a string")
        if m.get("path") and not value.strip():
            # "" would mean the current directory to os and pathlib: never what a user meant
            raise ValueError(f"{name}: got {value!r}; expected a folder path, e.g. "
                             f"{f.default if isinstance(f.default, str) else 'data/images'!r}"
                             + ("; leave it empty (None) for synthetic data" if m["optional"] else ""))
    choices = m["choices"]
    if choices is not None:
        allowed = choices.choices() if isinstance(choices, type) else list(choices)
        if value not in allowed:
            raise ValueError(f"{name}: got {value!r}; accepted: {', '.join(map(repr, allowed))}")
    lo, hi = m["lo"], m["hi"]
    if lo is not None and (value < lo or (m["lo_open"] and value == lo)):
        op = ">" if m["lo_open"] else ">="
        raise ValueError(f"{name}: got {value!r}; accepted: a value {op} {lo} and <= {hi}")
    if hi is not None and value > hi:
        op = ">" if m["lo_open"] else ">="
        raise ValueError(f"{name}: got {value!r}; accepted: a value {op} {lo} and <= {hi}")
    return value


__all__ = ["TrainConfig", "config_diff", "Optimizer", "Scheduler", "MixedPrecision", "Augment",
           "Decode", "MODEL_NAMES", "ALIASES"]
