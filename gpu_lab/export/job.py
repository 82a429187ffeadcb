"""JobSpec (what to run, where, on how much hardware) and Export (what an exporter produces)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..config import TrainConfig
from .entry import EntryError, parse_entry, resolve_entry

DEVICES = ("cuda", "cpu")
RDZV_BACKENDS = ("c10d", "static")
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")            # Slurm: [D-]HH[:MM[:SS]]
_QUANTITY = re.compile(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")   # Kubernetes resource quantity
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_1123 = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass
class JobSpec:
    """A training job for a cluster: the function, its TrainConfig and the hardware.

    Every field is checked on construction; an error names the field, the value and what is
    accepted. `check_import=False` skips importing the entry here (when the module exists only
    on the cluster); its syntax is still checked.
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
            from .entry import entry_of

            self.entry = entry_of(self.entry)
        parse_entry(self.entry)
        if self.check_import:
            resolve_entry(self.entry)
        if self.nproc_per_node is None:
            self.nproc_per_node = self.config.num_processes or 1
        for name, lo in (("num_nodes", 1), ("nproc_per_node", 1), ("port", 1),
                         ("cpus_per_task", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"JobSpec.{name}: got {v!r} ({type(v).__name__}); expected an int")
            if v < lo:
                raise ValueError(f"JobSpec.{name}: got {v}; accepted: an int >= {lo}")
        if self.port > 65535:
            raise ValueError(f"JobSpec.port: got {self.port}; accepted: 1..65535")
        if self.device not in DEVICES:
            raise ValueError(f"JobSpec.device: got {self.device!r}; accepted: "
                             f"{', '.join(map(repr, DEVICES))}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(f"JobSpec.rdzv_backend: got {self.rdzv_backend!r}; accepted: "
                             f"{', '.join(map(repr, RDZV_BACKENDS))}")
        if self.device == "cpu" and self.config.mixed_precision == "fp16":
            raise ValueError("JobSpec.device: 'cpu' with TrainConfig.mixed_precision='fp16'; "
                             "fp16 needs a GPU (accepted on CPU: 'no', 'bf16')")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"JobSpec.master_addr: got {self.master_addr!r}; expected a host "
                             "name, an address or a shell variable such as '$MASTER_ADDR'")
        if not _TIME.match(str(self.time_limit)):
            raise ValueError(f"JobSpec.time_limit: got {self.time_limit!r}; accepted: Slurm's "
                             "[D-]HH[:MM[:SS]], e.g. '24:00:00' or '2-00:00:00'")
        if not _QUANTITY.match(str(self.shm_size)):
            raise ValueError(f"JobSpec.shm_size: got {self.shm_size!r}; accepted: a Kubernetes "
                             "quantity such as '16Gi' or '512Mi'")
        for k in self.env:
            if not _ENV_NAME.match(str(k)):
                raise ValueError(f"JobSpec.env: {k!r} is not a valid environment variable name")
        self.env = {str(k): str(v) for k, v in self.env.items()}
        if self.runtime is not None and not _DNS_1123.match(str(self.runtime)):
            raise ValueError(f"JobSpec.runtime: got {self.runtime!r}; accepted: a Kubernetes "
                             "name (lower-case letters, digits and '-', at most 63 characters), "
                             "e.g. 'torch-distributed'")
        if self.define_runtime and self.runtime == "torch-distributed":
            raise ValueError("JobSpec.runtime: 'torch-distributed' with define_runtime=True would "
                             "replace the cluster's stock runtime; name yours, e.g. "
                             "runtime='gpu-lab-torch'")
        self.name = k8s_name(self.name or f"gpu-lab-{self.config.model}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * int(self.nproc_per_node)

    @property
    def function_name(self) -> str:
        return self.entry.split(":", 1)[1]

    def run_entry_args(self, config_path: str | None = None) -> list[str]:
        """`-m gpu_lab.run_entry MODULE:FUNCTION --config PATH`: what every rank runs."""
        return ["-m", "gpu_lab.run_entry", self.entry, "--config", config_path or self.config_path]

    def config_json(self) -> str:
        return self.config.to_json(indent=1) + "\n"


def k8s_name(name: str) -> str:
    """A DNS-1123 name (lower-case letters, digits, '-'; starts and ends alphanumeric), short
    enough that the operator's pod names ('<name>-worker-12') stay under 63 characters."""
    s = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")
    s = re.sub(r"-{2,}", "-", s)[:48].strip("-")
    if not s:
        raise ValueError(f"JobSpec.name: got {name!r}; expected letters or digits (it names the "
                         "job on the cluster)")
    return s


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
            p.write_text(text)
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


_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def shell_join(argv: list[str]) -> str:
    """Join arguments into a command line like shlex.join, except that an argument holding a
    shell variable ($MASTER_ADDR, ${NODE_RANK}) is double-quoted, so the shell still expands it."""
    out = []
    for a in argv:
        if _PLAIN.match(a):
            out.append(a)
        elif "$" in a and not re.search(r'["\\`]', a):
            out.append(f'"{a}"' if not re.fullmatch(r"[A-Za-z0-9_@%+=:,./${}-]+", a) else a)
        else:
            out.append(shlex.quote(a))
    return " ".join(out)


__all__ = ["JobSpec", "Export", "EntryError", "k8s_name", "shell_join", "DEVICES", "RDZV_BACKENDS"]
