"""gpu_lab.export: from one TrainConfig and a `module:function`, what a cluster needs to run it.

    from gpu_lab.export import export
    jobs = export(cfg, "gpu_lab.train:train_classifier", num_nodes=2, nproc_per_node=8,
                  out_dir="job/")
    jobs["torchrun"].command      # the line to type on each node
    jobs["slurm"].files           # {"train.sbatch": ..., "config.json": ...}
    jobs["kubernetes"].explanation

Targets: torchrun (one node, or several with a c10d rendezvous), accelerate (launch command +
config YAML), slurm (sbatch script: srun, SIGUSR1 before the time limit, requeue on exit 143),
kubernetes (Kubeflow training-operator v1 PyTorchJob + ConfigMap), trainjob (Kubeflow Trainer v2
TrainJob + ConfigMap, optionally a ClusterTrainingRuntime). `gpu_lab.export.grafana` writes a
Grafana dashboard for the server's Prometheus metrics. Every rank of every target runs
`python -m gpu_lab.rank.headless`, which records the run in the registry. Nothing here imports torch,
widgets or jupyter.

Exported files hold exactly what was asked (contracts in .checks and .quoting): every field is
checked when the JobSpec is made, and a value is either refused (ValueError naming the field, the
value and the rule; control characters such as newlines everywhere, Slurm and Kubernetes names
by their rules) or written so that it arrives intact: shell-quoted in commands and scripts, by
the YAML serializer in manifests. The one exception, on purpose: a value that is exactly `$NAME`
or `${NAME}` (master_addr, env values, config_path, python) is expanded by the node's shell.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..config import TrainConfig
from .accelerate_launch import accelerate_config_yaml, accelerate_launch
from ..rank.address import EntryError, entry_of, parse_entry, resolve_entry
from .job import Export, JobSpec, k8s_name
from .kubernetes import configmap_yaml, kubernetes, pytorchjob_yaml
from .quoting import shell_join
from .slurm import sbatch_script, slurm
from .torchrun import torchrun, torchrun_argv
from .trainjob import runtime_manifest, trainjob, trainjob_manifest

EXPORTERS: dict[str, Callable[[JobSpec], Export]] = {
    "torchrun": torchrun,
    "accelerate": accelerate_launch,
    "slurm": slurm,
    "kubernetes": kubernetes,
    "trainjob": trainjob,
}
TARGETS = tuple(EXPORTERS)


def export(config: TrainConfig | dict | None, entry: str | Callable, target: str = "all",
           out_dir: str | Path | None = None, **job: Any) -> Export | dict[str, Export]:
    """Export `entry` (a 'module:function' or a module-level function) with `config`.

    target: one of TARGETS, or "all" (a dict target -> Export). `job`: the JobSpec fields
    (num_nodes, nproc_per_node, name, device, master_addr, port, rdzv_backend, image, shm_size,
    namespace, time_limit, partition, account, qos, cpus_per_task, env, config_path, python,
    runtime, define_runtime, check_import).
    With out_dir, every file (config.json included) is written there. All input is checked
    before anything is written.
    """
    if target != "all" and target not in EXPORTERS:
        raise ValueError(f"export: target: got {target!r}; accepted: 'all', "
                         f"{', '.join(map(repr, TARGETS))}")
    spec = JobSpec(entry=entry, config=config if config is not None else TrainConfig(), **job)
    names = TARGETS if target == "all" else (target,)
    out = {name: EXPORTERS[name](spec) for name in names}
    if out_dir is not None:
        for e in out.values():
            e.write(out_dir)
    return out if target == "all" else out[target]


__all__ = ["export", "Export", "JobSpec", "EntryError", "TARGETS", "EXPORTERS", "torchrun",
           "accelerate_launch", "slurm", "kubernetes", "torchrun_argv", "accelerate_config_yaml",
           "sbatch_script", "pytorchjob_yaml", "configmap_yaml", "trainjob", "trainjob_manifest",
           "runtime_manifest", "parse_entry", "resolve_entry",
           "entry_of", "k8s_name", "shell_join"]
