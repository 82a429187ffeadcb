"""The user's `accelerate config`, read as `accelerate launch` reads it.

`launch()` takes accelerate's default config file (`$HF_HOME/accelerate/default_config.yaml`,
where `accelerate config` writes it) when there is one, or the file `config_file=` names
(`config_file=False`: none). accelerate's own code reads the file, merges it with the flags
and builds the environment a rank gets (`accelerate.commands.launch`'s parser and its merge of
file and flags, `accelerate.utils.launch`'s builders), so a setting accelerate adds tomorrow
reaches the ranks with no change here. gpu_lab keeps what it decides by design (BY_DESIGN: the
ranks' addresses, their devices, their threads, the CPU switch), and maps the file's counts onto
launch()'s own: num_processes, gpu_ids (→ `gpus`), num_machines, machine_rank,
main_process_ip and main_process_port (→ num_nodes, node_rank, master_addr, port).

Precedence, as in `accelerate launch`: launch()'s arguments are its flags and win over the file;
the file wins over a TrainConfig field left at its default value. A default cannot be told from
the same value set on purpose, so a TrainConfig counts as saying what differs from its defaults:
to insist on fp32 against a file that says bf16, pass `launch(..., mixed_precision="no")`.

Nothing is silent: what this host cannot honour is refused before anything starts (fp16, fp8,
FSDP or DeepSpeed without a GPU, DeepSpeed without its package, gpu_ids that are not here, a
multi-machine file without the main machine's address), and a setting gpu_lab does not pass on
is named in a warning.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

# what a launch sets itself: the rendezvous (addresses, ranks, world size), the devices a rank
# sees (claimed in the host's queue), its intra-op threads (the supervisor's rule), the CPU switch
BY_DESIGN = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES",
                       "OMP_NUM_THREADS", "ACCELERATE_USE_CPU",
                       "PYTHONPATH"})  # (a forked rank imports what the kernel can)
# the file's fields gpu_lab takes, as launch() arguments or through the environment accelerate
# builds from them; any other field that is set draws a warning
TAKEN = frozenset({"compute_environment", "distributed_type", "mixed_precision", "use_cpu",
                   "debug", "num_processes", "machine_rank", "num_machines", "gpu_ids",
                   "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
                   "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
                   "parallelism_config", "megatron_lm_config", "dynamo_config",
                   "main_training_function"})


class AccelerateConfigError(ValueError):
    """The config file asks for what this host, or gpu_lab, cannot do; the message says what."""


@dataclasses.dataclass
class Settings:
    """What a config file gives a launch: the ranks' environment (`env`), the counts that map
    onto launch()'s arguments (None where the file leaves them to gpu_lab), and for the record
    the file and the fields it sets (`set`)."""

    file: str
    env: dict[str, str]
    mixed_precision: str
    distributed_type: str
    num_processes: int | None = None
    gpus: list[int] | None = None
    num_nodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    port: int | None = None
    use_cpu: bool = False
    set: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_passed: list[str] = dataclasses.field(default_factory=list)

    @property
    def sharding(self) -> str:
        """none | fsdp | deepspeed stage N | megatron: what the file asks the ranks to shard."""
        if self.distributed_type == "FSDP":
            return f"fsdp{self.env.get('FSDP_VERSION', '1')}"
        if self.distributed_type == "DEEPSPEED":
            return f"deepspeed stage {self.env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '?')}"
        if self.distributed_type == "MEGATRON_LM":
            return "megatron"
        return "none"

    def record(self) -> dict[str, Any]:
        """What the run's record keeps: the file, what it set, what reaches the ranks."""
        return {"file": self.file, "set": self.set, "mixed_precision": self.mixed_precision,
                "distributed_type": self.distributed_type, "sharding": self.sharding,
                "env": dict(sorted(self.env.items())), "not_passed": self.not_passed}


def default_file() -> Path:
    """Where `accelerate config` writes and `accelerate launch` reads by default, read now
    (accelerate reads HF_HOME once, when it is first imported)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def resolve(config_file: Any) -> Path | None:
    """The file a launch reads: `config_file` (a path), the default one where it exists (None),
    or no file (False)."""
    if config_file is False:
        return None
    if config_file is None:
        path = default_file()
        return path if path.is_file() else None
    if not isinstance(config_file, (str, os.PathLike)):
        raise ValueError(f"launch: config_file={config_file!r}; accepted: the path of an "
                         "accelerate config file (YAML or JSON), None (accelerate's default file, "
                         "where there is one) or False (none)")
    path = Path(config_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"launch: config_file={str(config_file)!r} does not exist; "
                                "`accelerate config --config_file PATH` writes one")
    return path


def said(num_processes: int | None, mixed_precision: str | None, config: Any,
          num_nodes: int, node_rank: int, master_addr: str, port: int | None) -> dict[str, Any]:
    """What this launch says itself, as `accelerate launch` flags would: its arguments that were
    given, and its TrainConfig's fields that differ from their defaults."""
    from ..config import TrainConfig

    said: dict[str, Any] = {}
    defaults = TrainConfig.field_help()
    if num_processes is not None:
        said["num_processes"] = num_processes
    elif config is not None and config.num_processes is not None:
        said["num_processes"] = config.num_processes
    if mixed_precision is not None:
        said["mixed_precision"] = mixed_precision
    elif config is not None and config.mixed_precision != defaults["mixed_precision"]["default"]:
        said["mixed_precision"] = config.mixed_precision
    for key, value, default in (("num_nodes", num_nodes, 1), ("node_rank", node_rank, 0),
                                ("master_addr", master_addr, "127.0.0.1"), ("port", port, None)):
        if value != default:
            said[key] = value
    return said


def settings(config_file: Any, said: dict[str, Any], visible: int) -> Settings | None:
    """The user's accelerate config, read as `accelerate launch` reads it (None without one)."""
    if config_file is False:
        return None
    if config_file is None and not default_file().is_file():
        return None  # the common case: no file, nothing to import
    return read(config_file, explicit=said, device="cuda" if visible > 0 else "cpu",
                gpu_indices=list(range(visible)))


def _flags(explicit: dict[str, Any]) -> list[str]:
    """launch()'s arguments as `accelerate launch` flags (they win over the file)."""
    names = {"mixed_precision": "--mixed_precision", "num_processes": "--num_processes",
             "num_nodes": "--num_machines", "node_rank": "--machine_rank",
             "master_addr": "--main_process_ip", "port": "--main_process_port"}
    out = []
    for key, flag in names.items():
        if explicit.get(key) is not None:
            out += [flag, str(explicit[key])]
    return out


def _set_fields(defaults: Any) -> dict[str, Any]:
    """The file's fields that differ from accelerate's defaults (what the file really says)."""
    out = {}
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        value = getattr(value, "value", value)  # enums as their words
        default = f.default if f.default is not dataclasses.MISSING else None
        # accelerate's own writer spells an off switch "no" (downcast_bf16: 'no')
        off = default is False and value in ("no", "false", "False")
        if value in (None, {}, []) or value == default or off:
            continue
        out[f.name] = value
    return out


def _environment(args: Any, defaults: Any, mp_from_file: bool) -> dict[str, str]:
    """The environment accelerate's launcher gives a rank for `args`, less the one it started
    from: the branch `accelerate launch` takes for this file (accelerate.commands.launch's
    launch_command, whose preparation of a DeepSpeed launch is repeated here)."""
    from accelerate.utils import launch as builders

    if args.use_deepspeed and not args.cpu:
        fields = list((defaults.deepspeed_config or {}).keys()) + (
            ["mixed_precision"] if mp_from_file else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _cmd, env = builders.prepare_deepspeed_cmd_env(args)
    elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
        env = builders.prepare_multi_gpu_env(args)
    else:
        _cmd, env = builders.prepare_simple_launcher_cmd_env(args)
    return {k: str(v) for k, v in env.items() if os.environ.get(k) != v}


def read(config_file: Any, *, explicit: dict[str, Any], device: str,
         gpu_indices: list[int]) -> Settings | None:
    """The Settings a launch takes from `config_file` (see resolve), or None without a file.
    `explicit`: launch()'s arguments that were given (mixed_precision, num_processes, num_nodes,
    node_rank, master_addr, port); `device`: "cuda" or "cpu"; `gpu_indices`: this host's GPUs."""
    path = resolve(config_file)
    if path is None:
        return None
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    except ImportError as e:  # pragma: no cover - a different accelerate than the one pinned
        raise AccelerateConfigError(f"this accelerate cannot read config files the way its "
                                    f"launcher does ({e}); pass config_file=False") from None
    args = launch_command_parser().parse_args(["--config_file", str(path), *_flags(explicit),
                                               "gpu_lab_rank"])
    try:
        args, defaults, mp_from_file = _validate_launch_command(args)
    except (ValueError, TypeError, KeyError) as e:
        raise AccelerateConfigError(f"{path}: accelerate refuses it: {e}") from None
    if defaults is None or getattr(defaults.compute_environment, "value", "") != "LOCAL_MACHINE":
        where = getattr(getattr(defaults, "compute_environment", None), "value", "?")
        raise AccelerateConfigError(f"{path}: compute_environment {where!r}; gpu_lab launches on "
                                    "this machine (LOCAL_MACHINE) or through Slurm "
                                    "(gpu_lab.submit)")
    said = _set_fields(defaults)
    kind = getattr(defaults.distributed_type, "value", str(defaults.distributed_type))
    use_cpu = bool(getattr(defaults, "use_cpu", False)) or device == "cpu"
    _check_host(path, args, kind, use_cpu, gpu_indices)
    if use_cpu:
        args.cpu = True  # the branch accelerate takes for a CPU run
    try:
        env = _environment(args, defaults, mp_from_file)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise AccelerateConfigError(f"{path}: {e}") from None
    env = {k: v for k, v in env.items() if k not in BY_DESIGN}
    not_passed = sorted(k for k in said if k not in TAKEN)
    if not_passed:
        warnings.warn(f"{path}: gpu_lab does not pass on {', '.join(not_passed)} (for TPUs, "
                      "SageMaker or mpirun); the rest of the file reaches the ranks",
                      stacklevel=3)
    n = defaults.num_processes if defaults.num_processes and defaults.num_processes > 0 else None
    gpus = None
    if args.gpu_ids not in (None, "all"):
        gpus = [int(g) for g in str(args.gpu_ids).split(",") if g.strip()]
    machines = defaults.num_machines if defaults.num_machines and defaults.num_machines > 1 else None
    return Settings(file=str(path), env=env, mixed_precision=str(args.mixed_precision),
                    distributed_type=kind, num_processes=n // (machines or 1) if n else None,
                    gpus=gpus, num_nodes=machines,
                    node_rank=defaults.machine_rank if machines else None,
                    master_addr=defaults.main_process_ip if machines else None,
                    port=defaults.main_process_port if machines else None,
                    use_cpu=bool(getattr(defaults, "use_cpu", False)), set=said,
                    not_passed=not_passed)


def has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _check_host(path: Path, args: Any, kind: str, cpu: bool, gpu_indices: list[int]) -> None:
    """Refuse what this host cannot honour, naming the setting and what the host can do."""
    where = f"{path}:"
    if cpu:
        can = "this host runs CPU ranks (gloo): mixed_precision no or bf16, no sharding"
        if str(args.mixed_precision).lower() in ("fp16", "fp8"):
            raise AccelerateConfigError(f"{where} mixed_precision: {args.mixed_precision} needs a "
                                        f"GPU; {can}")
        if kind == "FSDP":
            raise AccelerateConfigError(
                f"{where} distributed_type: FSDP needs GPUs (on a CPU, accelerate would wrap "
                f"the model in DDP and shard nothing); {can}. TrainConfig(sharding='zero1') "
                "shards the optimizer state on CPU ranks")
        if kind in ("DEEPSPEED", "MEGATRON_LM", "XLA"):
            raise AccelerateConfigError(f"{where} distributed_type: {kind} needs GPUs (or TPUs); "
                                        f"{can}")
        if args.gpu_ids not in (None, "all"):
            raise AccelerateConfigError(f"{where} gpu_ids: {args.gpu_ids} but this host has no "
                                        "GPU (NVML sees none); use gpu_ids: all, or a file "
                                        "without them")
    elif args.gpu_ids not in (None, "all"):
        want = [g.strip() for g in str(args.gpu_ids).split(",") if g.strip()]
        missing = [g for g in want if not g.isdigit() or int(g) not in gpu_indices]
        if missing:
            raise AccelerateConfigError(f"{where} gpu_ids: {args.gpu_ids} names GPU(s) "
                                        f"{', '.join(missing)}, but this host's GPUs are "
                                        f"{', '.join(map(str, gpu_indices)) or 'none'}")
    if kind == "DEEPSPEED" and not has_deepspeed():
        raise AccelerateConfigError(f"{where} distributed_type: DEEPSPEED, but the deepspeed "
                                    "package is not installed here: `pip install deepspeed`, or "
                                    "choose FSDP for sharding (`accelerate config`)")
    machines = args.num_machines or 1
    if machines > 1 and not args.main_process_ip:
        raise AccelerateConfigError(f"{where} num_machines: {machines} without main_process_ip; "
                                    "accepted: the address of machine 0 in main_process_ip (or "
                                    "launch(..., master_addr=...))")


__all__ = ["AccelerateConfigError", "BY_DESIGN", "Settings", "default_file", "read", "resolve",
           "said", "settings"]
