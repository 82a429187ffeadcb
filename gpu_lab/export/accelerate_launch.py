"""`accelerate launch` with an accelerate config YAML (what `accelerate config` would write)."""
from __future__ import annotations

import json

from .job import Export, JobSpec, shell_join

CONFIG_FILE = "accelerate_config.yaml"


def accelerate_config_yaml(spec: JobSpec) -> str:
    """accelerate's config file for `spec`. accelerate counts num_processes over all machines."""
    total = spec.world_size
    if spec.device == "cpu":
        dist = "MULTI_CPU" if total > 1 else "NO"
    else:
        dist = "MULTI_GPU" if total > 1 else "NO"
    lines = [
        f"# accelerate config for {spec.name}: {spec.num_nodes} node(s) x {spec.nproc_per_node} "
        f"{'GPU(s)' if spec.device == 'cuda' else 'CPU process(es)'}",
        "# use: accelerate launch --config_file accelerate_config.yaml ...",
        "compute_environment: LOCAL_MACHINE",
        f"distributed_type: {dist}",
        f"num_machines: {spec.num_nodes}",
        f"num_processes: {total}  # over all machines: {spec.num_nodes} x {spec.nproc_per_node}",
        "machine_rank: 0  # each node passes its own --machine_rank on the command line",
        f"mixed_precision: {spec.config.mixed_precision}",
        f"use_cpu: {'true' if spec.device == 'cpu' else 'false'}",
        "gpu_ids: all",
        "downcast_bf16: 'no'",
        "debug: false",
        "enable_cpu_affinity: false",
        "main_training_function: main",
        "tpu_env: []",
        "tpu_use_cluster: false",
        "tpu_use_sudo: false",
    ]
    if spec.num_nodes > 1:
        lines += [f"main_process_port: {spec.port}",
                  f"rdzv_backend: {spec.rdzv_backend}",
                  "same_network: true"]
        if not spec.master_addr.startswith("$"):
            lines.append(f"main_process_ip: {json.dumps(spec.master_addr)}")
    return "\n".join(lines) + "\n"


def accelerate_launch(spec: JobSpec) -> Export:
    argv = ["accelerate", "launch", "--config_file", CONFIG_FILE]
    if spec.num_nodes > 1:
        argv += ["--machine_rank", "${NODE_RANK}"]
        if spec.master_addr.startswith("$"):
            argv += ["--main_process_ip", spec.master_addr]
    argv += spec.run_entry_args()
    command = shell_join([f"{k}={v}" for k, v in spec.env.items()] + argv)
    n = spec.num_nodes
    text = [
        "`accelerate launch` reads the machine layout from `accelerate_config.yaml` (the file "
        "`accelerate config` would write after its questions) and starts torchrun's agent with it. "
        f"accelerate counts `num_processes` over all machines: {spec.world_size} = {n} x "
        f"{spec.nproc_per_node}. `-m gpu_lab.run_entry {spec.entry}` makes every process run "
        "the same entry point as the torchrun export, so metrics reach the run registry the "
        "same way.",
        "",
        f"`mixed_precision: {spec.config.mixed_precision}` in the YAML matches the TrainConfig; "
        "gpu_lab's fit() passes the config's value to its Accelerator, which wins for the "
        "model it prepares.",
    ]
    if n > 1:
        text += ["", f"On each of the {n} nodes run the same command with NODE_RANK=0..{n - 1} "
                     "(0 where the main process runs) and MASTER_ADDR set to that node's "
                     "address."]
    files = {CONFIG_FILE: accelerate_config_yaml(spec), "config.json": spec.config_json()}
    return Export("accelerate", command, files, "\n".join(text), spec)
