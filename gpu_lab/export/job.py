"""JobSpec (what to run, where, on how much hardware) and Export (what an exporter produces).

Every field is checked on construction (gpu_lab.export.checks): a value is accepted as given or
refused with a message naming the field, the value and the rule; nothing is rewritten, except
that the default job name is made from the model's name. How accepted values are written into
files is gpu_lab.export.quoting's contract.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import checks
from ..config import TrainConfig
from ..rank.address import EntryError, parse_entry, resolve_entry
from .quoting import shell_join, value

DEVICES = ("cuda", "cpu")
RDZV_BACKENDS = ("c10d", "static")


@dataclass
class JobSpec:
    """A training job for a cluster: the function, its TrainConfig and the hardware.

    Every field is checked on construction; an error names the field, the value and what is
    accepted. master_addr, config_path, python and env values that are exactly `$NAME` or
    `${NAME}` are expanded by the shell on the node (see gpu_lab.export.quoting); every other
    value is literal. `check_import=False` skips importing the entry here (when the module
    exists only on the cluster); its syntax is still checked.
    """

    entry: str
    config: TrainConfig = field(default_factory=TrainConfig)
    num_nodes: int = 1
    nproc_per_node: int | None = None   # processes (GPUs) per node; None: config.num_processes or 1
    name: str | None = None             # job name; None: "gpu-lab-<model>"
    device: str = "cuda"                # "cuda": one process per GPU; "cpu": gloo, no GPU request
    master_addr: str = "$MASTER_ADDR"   # multi-node rendezvous host (a shell variable by default)
    port: int = 29400                   # rendezvous port (torchrun's c10d default)
    rdzv_backend: str = "c10d"
    config_path: str = "config.json"    # where the TrainConfig JSON is, relative to the job's cwd
    python: str = "python"
    env: dict[str, str] = field(default_factory=dict)
    # Slurm
    time_limit: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int = 8
    # Kubernetes
    image: str = "gpu-lab:latest"
    shm_size: str = "16Gi"
    namespace: str | None = None
    # Kubeflow Trainer v2 (TrainJob): the ClusterTrainingRuntime to run on (None: the stock
    # "torch-distributed", or "gpu-lab-torch" with define_runtime), and whether to write one
    runtime: str | None = None
    define_runtime: bool = False
    check_import: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.config, Mapping):
            self.config = TrainConfig.from_dict(self.config)
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"JobSpec.config: got {type(self.config).__name__}; expected a "
                            "TrainConfig or a dict of its fields")
        if callable(self.entry):
            from ..rank.address import entry_of

            self.entry = entry_of(self.entry)
        checks.text("JobSpec.entry", self.entry)
        parse_entry(self.entry)
        self.entry = self.entry.strip()  # the address itself; spaces around it mean nothing
        if self.check_import:
            resolve_entry(self.entry)
        if self.nproc_per_node is None:
            self.nproc_per_node = self.config.num_processes or 1
        self._check_numbers()
        self._check_choices()
        self._check_slurm()
        self._check_kubernetes()
        self.master_addr = checks.master_addr("JobSpec.master_addr", self.master_addr)
        checks.word("JobSpec.config_path", self.config_path, "a path (write './-x' for '-x')")
        checks.word("JobSpec.python", self.python, "a program name or path")
        self.env = checks.env("JobSpec.env", self.env)
        if self.name is None:
            self.name = k8s_name(f"gpu-lab-{self.config.model}")
        else:
            checks.dns_label("JobSpec.name", self.name, checks.MAX_NAME, _suggest(self.name))

    def _check_numbers(self) -> None:
        for name, lo in (("num_nodes", 1), ("nproc_per_node", 1), ("port", 1),
                         ("cpus_per_task", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"JobSpec.{name}: got {v!r} ({type(v).__name__}); expected an int")
            if v < lo:
                raise ValueError(f"JobSpec.{name}: got {v}; accepted: an int >= {lo}")
        if self.port > 65535:
            raise ValueError(f"JobSpec.port: got {self.port}; accepted: 1..65535")

    def _check_choices(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"JobSpec.device: got {self.device!r}; accepted: "
                             f"{', '.join(map(repr, DEVICES))}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(f"JobSpec.rdzv_backend: got {self.rdzv_backend!r}; accepted: "
                             f"{', '.join(map(repr, RDZV_BACKENDS))}")
        if self.device == "cpu" and self.config.mixed_precision == "fp16":
            raise ValueError("JobSpec.device: 'cpu' with TrainConfig.mixed_precision='fp16'; "
                             "fp16 needs a GPU (accepted on CPU: 'no', 'bf16')")

    def _check_slurm(self) -> None:
        checks.pattern("JobSpec.time_limit", self.time_limit, checks.SLURM_TIME,
                       "one of Slurm's time formats, MM, MM:SS, [D-]HH[:MM[:SS]] or UNLIMITED, "
                       "e.g. '24:00:00' or '2-00:00:00'", 64)
        if self.partition is not None:
            checks.slurm_name("JobSpec.partition", self.partition, "partition", allow_list=True)
        if self.account is not None:
            checks.slurm_name("JobSpec.account", self.account, "account")
        if self.qos is not None:
            checks.slurm_name("JobSpec.qos", self.qos, "QOS")

    def _check_kubernetes(self) -> None:
        checks.pattern("JobSpec.shm_size", self.shm_size, checks.QUANTITY,
                       "a Kubernetes quantity such as '16Gi' or '512Mi'", 64)
        checks.pattern("JobSpec.image", self.image, checks.IMAGE,
                       "a container image reference, [registry[:port]/]path[:tag][@digest] "
                       "with a lower-case path, e.g. 'registry.example.com/team/train:1.2'", 255)
        if self.namespace is not None:
            checks.dns_label("JobSpec.namespace", self.namespace, hint=", e.g. 'team-a'")
        if self.runtime is not None:
            checks.dns_subdomain("JobSpec.runtime", self.runtime, "torch-distributed")
        if self.define_runtime and self.runtime == "torch-distributed":
            raise ValueError("JobSpec.runtime: 'torch-distributed' with define_runtime=True would "
                             "replace the cluster's stock runtime; name yours, e.g. "
                             "runtime='gpu-lab-torch'")

    @property
    def world_size(self) -> int:
        return self.num_nodes * int(self.nproc_per_node)

    @property
    def function_name(self) -> str:
        return self.entry.split(":", 1)[1]

    def headless_args(self, config_path: str | None = None) -> list:
        """`-m gpu_lab.rank.headless MODULE:FUNCTION --config PATH`: what every rank runs."""
        return ["-m", "gpu_lab.rank.headless", self.entry, "--config",
                value(config_path or self.config_path)]

    def config_json(self) -> str:
        return self.config.to_json(indent=1) + "\n"


def k8s_name(name: str) -> str:
    """`name` made into a DNS-1123 name (lower-case letters, digits, '-'; starts and ends
    alphanumeric), short enough that the operator's pod names ('<name>-worker-12') stay under 63
    characters. Used for the default job name (from the model); a name the user gives is checked,
    not rewritten."""
    s = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")
    s = re.sub(r"-{2,}", "-", s)[:checks.MAX_NAME].strip("-")
    if not s:
        raise ValueError(f"JobSpec.name: got {name!r}; expected letters or digits (it names the "
                         "job on the cluster)")
    return s


def _suggest(name: str) -> str:
    try:
        return f", e.g. {k8s_name(name)!r}"
    except ValueError:
        return ""


@dataclass
class Export:
    """One exported artefact set: the command to type, the files it needs, and why it looks so.

    `files` maps file names to their text (config.json included); `write(directory)` puts them
    there. `explanation` is Markdown, shown by notebooks (`_repr_markdown_`).
    """

    target: str
    command: str
    files: dict[str, str]
    explanation: str
    spec: JobSpec | None = field(default=None, repr=False)

    @property
    def argv(self) -> list[str]:
        """The command as an argument list (shell variables such as $MASTER_ADDR unexpanded)."""
        return shlex.split(self.command)

    def write(self, directory: str | Path) -> list[Path]:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out = []
        for name, text in self.files.items():
            p = d / name
            p.write_text(text, encoding="utf-8")
            if text.startswith("#!"):
                p.chmod(0o755)
            out.append(p)
        return out

    def __str__(self) -> str:
        return self.command

    def _repr_markdown_(self) -> str:
        files = ", ".join(f"`{n}`" for n in self.files)
        return (f"**{self.target}** · files: {files}\n\n```bash\n{self.command}\n```\n\n"
                f"{self.explanation}")


__all__ = ["JobSpec", "Export", "EntryError", "k8s_name", "shell_join", "DEVICES", "RDZV_BACKENDS"]
