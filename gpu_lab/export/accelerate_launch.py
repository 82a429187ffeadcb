"""`accelerate launch` with an accelerate config YAML (what `accelerate config` would write).

The YAML is dumped by the serializer (gpu_lab.export.quoting.dump_yaml); the command is built
from shell words, so environment values and the rendezvous host reach accelerate as given (a
master_addr of exactly `$NAME` / `${NAME}` goes on the command line, expanded by the node's
shell; a host name goes into the YAML).
"""
from __future__ import annotations

from .checks import is_var_ref
from .job import Export, JobSpec
from .quoting import Ref, dump_yaml, env_assignment, shell_join, value

CONFIG_FILE = "accelerate_config.yaml"


def accelerate_config(spec: JobSpec) -> dict:
    """accelerate's config for `spec`. accelerate counts num_processes over all machines."""
    total = spec.world_size
    if spec.device == "cpu":
        dist = "MULTI_CPU" if total > 1 else "NO"
    else:
        dist = "MULTI_GPU" if total > 1 else "NO"
    doc = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": dist,
        "num_machines": spec.num_nodes,
        "num_processes": total,
        "machine_rank": 0,
        "mixed_precision": spec.config.mixed_precision,
        "use_cpu": spec.device == "cpu",
        "gpu_ids": "all",
        "downcast_bf16": "no",
        "debug": False,
        "enable_cpu_affinity": False,
        "main_training_function": "main",
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
    }
    if spec.num_nodes > 1:
        doc.update(main_process_port=spec.port, rdzv_backend=spec.rdzv_backend,
                   same_network=True)
        if not is_var_ref(spec.master_addr):
            doc["main_process_ip"] = spec.master_addr
    return doc


def accelerate_config_yaml(spec: JobSpec) -> str:
    what = "GPU(s)" if spec.device == "cuda" else "CPU process(es)"
    return dump_yaml(
        f"# accelerate config for {spec.name}: {spec.num_nodes} node(s) x {spec.nproc_per_node} "
        f"{what}\n# use: accelerate launch --config_file {CONFIG_FILE} ...\n"
        f"# num_processes counts all machines ({spec.num_nodes} x {spec.nproc_per_node}); each "
        "node passes\n# its own --machine_rank on the command line\n",
        accelerate_config(spec))


def accelerate_launch(spec: JobSpec) -> Export:
    argv: list = ["accelerate", "launch", "--config_file", CONFIG_FILE]
    if spec.num_nodes > 1:
        argv += ["--machine_rank", Ref("${NODE_RANK}")]
        if is_var_ref(spec.master_addr):
            argv += ["--main_process_ip", value(spec.master_addr)]
    argv += spec.headless_args()
    command = shell_join([env_assignment(k, v) for k, v in spec.env.items()] + argv)
    n = spec.num_nodes
    text = [
        "`accelerate launch` reads the machine layout from `accelerate_config.yaml` (the file "
        "`accelerate config` would write after its questions) and starts torchrun's agent with it. "
        f"accelerate counts `num_processes` over all machines: {spec.world_size} = {n} x "
        f"{spec.nproc_per_node}. `-m gpu_lab.rank.headless {spec.entry}` makes every process run "
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
