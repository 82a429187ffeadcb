"""A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1), optionally with the
ClusterTrainingRuntime it runs on, and the ConfigMap with the config.

Trainer v2 replaced the training operator's PyTorchJob: a TrainJob names a runtime (by default the
cluster's stock `torch-distributed` ClusterTrainingRuntime) and says what to train and on how many
nodes. The runtime's torch policy gives every node's container the PET_NNODES, PET_NPROC_PER_NODE,
PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT variables, which torchrun reads as its own
options, so the container's command is plain `torchrun -m gpu_lab.rank.headless ...`.

Runtime layout: one replicated job `node` whose container is `node`, as in the stock runtime of
Trainer v2; the TrainJob's podSpecOverrides target that name to mount the config (and, on the stock
runtime, a memory-backed /dev/shm). `define_runtime=True` also writes a ClusterTrainingRuntime for
the image, with /dev/shm and a restart budget, and points the TrainJob at it.

The manifests are objects dumped by the YAML serializer; env values are data with `$` doubled
for Kubernetes' `$(VAR)` expansion, as in the PyTorchJob (gpu_lab.export.kubernetes).
"""
from __future__ import annotations

from .job import Export, JobSpec
from .kubernetes import CONFIG_MOUNT, CONFIGMAP_FILE, object_meta, configmap_yaml, pod_env
from .quoting import dump_yaml

API_VERSION = "trainer.kubeflow.org/v1alpha1"
JOB_FILE = "trainjob.yaml"
RUNTIME_FILE = "clustertrainingruntime.yaml"
STOCK_RUNTIME = "torch-distributed"  # installed with Kubeflow Trainer
OWN_RUNTIME = "gpu-lab-torch"        # the runtime define_runtime writes, unless named otherwise
NODE = "node"                        # the runtime's replicated job and its container
MAX_RESTARTS = 3                     # JobSet restarts (preemption, node loss) before the job fails


def runtime_name(spec: JobSpec) -> str:
    if spec.runtime:
        return spec.runtime
    return OWN_RUNTIME if spec.define_runtime else STOCK_RUNTIME


def node_command(spec: JobSpec) -> list[str]:
    """What each node's container runs: torchrun takes nodes, ranks and rendezvous from PET_*."""
    return ["torchrun", *map(str, spec.headless_args(f"{CONFIG_MOUNT}/config.json"))]


def _shm_volume(spec: JobSpec) -> dict:
    # DataLoader workers and NCCL pass tensors through /dev/shm; a container gets 64 MiB
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}


def _resources(spec: JobSpec) -> dict:
    g = int(spec.nproc_per_node)
    if spec.device == "cuda":
        return {"limits": {"nvidia.com/gpu": g}, "requests": {"nvidia.com/gpu": g}}
    cpus = g * spec.cpus_per_task
    return {"limits": {"cpu": cpus}, "requests": {"cpu": cpus}}


def trainjob_manifest(spec: JobSpec) -> dict:
    volumes = [{"name": "config", "configMap": {"name": spec.name + "-config"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    if not spec.define_runtime:  # gpu_lab's own runtime has /dev/shm already
        volumes.append(_shm_volume(spec))
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    env = pod_env(spec)
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": object_meta(spec, spec.name, labels=True),
        "spec": {
            "runtimeRef": {"name": runtime_name(spec), "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": spec.image,
                "command": node_command(spec),
                "env": env,
                "numNodes": spec.num_nodes,
                "numProcPerNode": int(spec.nproc_per_node),
                "resourcesPerNode": _resources(spec),
            },
            "podSpecOverrides": [{
                "targetJobs": [{"name": NODE}],
                "volumes": volumes,
                "containers": [{"name": NODE, "volumeMounts": mounts}],
            }],
        },
    }


def runtime_manifest(spec: JobSpec) -> dict:
    """A ClusterTrainingRuntime for spec.image: torch policy, /dev/shm, a restart budget."""
    meta = {"name": runtime_name(spec),
            "labels": {"trainer.kubeflow.org/framework": "torch",
                       "app.kubernetes.io/created-by": "gpu_lab"}}
    pod = {
        "containers": [{
            "name": NODE,
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [_shm_volume(spec)],
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": MAX_RESTARTS},
                "replicatedJobs": [{
                    "name": NODE,
                    "template": {
                        "metadata": {"labels": {
                            "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                        "spec": {"template": {"spec": pod}},
                    },
                }],
            }},
        },
    }


def trainjob_yaml(spec: JobSpec) -> str:
    what = "GPU" if spec.device == "cuda" else "CPU process"
    runtime = f"{RUNTIME_FILE} -f " if spec.define_runtime else ""
    return dump_yaml(f"# {spec.name}: {spec.num_nodes} node(s) x {spec.nproc_per_node} "
                     f"{what}(s), {spec.entry} (exported by gpu_lab)\n"
                     f"# kubectl apply -f {runtime}{CONFIGMAP_FILE} -f {JOB_FILE}\n",
                     trainjob_manifest(spec))


def runtime_yaml(spec: JobSpec) -> str:
    return dump_yaml(f"# the runtime {spec.name} trains on: image {spec.image}, memory-backed "
                     f"/dev/shm of {spec.shm_size}, {MAX_RESTARTS} restarts "
                     "(exported by gpu_lab)\n",
                     runtime_manifest(spec))


def trainjob(spec: JobSpec) -> Export:
    n, g = spec.num_nodes, spec.nproc_per_node
    runtime = runtime_name(spec)
    per_node = (f"{g} `nvidia.com/gpu`" if spec.device == "cuda" else
                f"{g} gloo rank(s) on {g * spec.cpus_per_task} CPUs")
    text = [
        f"A Kubeflow Trainer v2 TrainJob on the `{runtime}` ClusterTrainingRuntime: {n} node(s), "
        f"each with {per_node}. The runtime's torch policy sets PET_NNODES, PET_NPROC_PER_NODE, "
        "PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in every node's container; torchrun "
        f"reads them as its options and starts {g} rank(s) per node, each running "
        f"`gpu_lab.rank.headless {spec.entry}` with the TrainConfig mounted from the ConfigMap at "
        f"{CONFIG_MOUNT}/config.json.",
        "",
        f"/dev/shm is memory-backed ({spec.shm_size}): DataLoader workers pass batches through "
        "shared memory, and a container's default 64 MiB ends in 'bus error' at the first large "
        "batch.",
        "",
        ("The ClusterTrainingRuntime in " + RUNTIME_FILE + f" runs the image {spec.image}, holds "
         f"/dev/shm, and lets JobSet restart the job {MAX_RESTARTS} times (preemption, node loss); "
         "apply it once per cluster." if spec.define_runtime else
         f"The stock `{STOCK_RUNTIME}` runtime comes with Kubeflow Trainer; the TrainJob's "
         f"podSpecOverrides add the config and /dev/shm to its `{NODE}` job. Pass "
         "define_runtime=True (`--define-runtime`) for a runtime of your own image."),
        "",
        "Clusters still on the training operator v1 run the PyTorchJob of the `kubernetes` "
        "target instead.",
    ]
    files = {CONFIGMAP_FILE: configmap_yaml(spec), JOB_FILE: trainjob_yaml(spec),
             "config.json": spec.config_json()}
    cmd = f"kubectl apply -f {CONFIGMAP_FILE} -f {JOB_FILE}"
    if spec.define_runtime:
        files[RUNTIME_FILE] = runtime_yaml(spec)
        cmd = f"kubectl apply -f {RUNTIME_FILE} -f {CONFIGMAP_FILE} -f {JOB_FILE}"
    return Export("trainjob", cmd, files, "\n".join(text), spec)
