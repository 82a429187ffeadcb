"""A Kubeflow PyTorchJob (training-operator, kubeflow.org/v1) and the ConfigMap with the config.

The operator creates one Master pod and `num_nodes - 1` Worker pods and gives each MASTER_ADDR,
MASTER_PORT, WORLD_SIZE (pods) and RANK (the pod's index, Master = 0). Each pod runs torchrun for
its GPUs with those as node rank and rendezvous address.

The manifests are built as objects and dumped by the YAML serializer (quoting.dump_yaml); what
they hold is exactly the objects below. Env values are data, not shell: `$` is doubled
(quoting.k8s_literal) so that Kubernetes' `$(VAR)` expansion leaves them as given. The command's
`$(RANK)`, `$(MASTER_ADDR)` and `$(MASTER_PORT)` are the exporter's own references, expanded by
Kubernetes from the env the operator sets.
"""
from __future__ import annotations

from .job import Export, JobSpec
from .quoting import dump_yaml, k8s_literal

JOB_FILE = "pytorchjob.yaml"
CONFIGMAP_FILE = "configmap.yaml"
CONFIG_MOUNT = "/etc/gpu_lab"
# why the manifest looks so (a serializer drops comments inside the document)
_NOTES = """\
# runPolicy.backoffLimit: pod restarts (preemption, node loss) before the job fails
# runPolicy.cleanPodPolicy None: finished pods are kept, so their logs can be read
# container 'pytorch': the name the operator looks for
# volume dshm: shared memory for DataLoader workers and NCCL (a container gets 64 MiB)
"""


def pod_command(spec: JobSpec) -> list[str]:
    """torchrun inside a pod; $(VAR) is expanded by Kubernetes from the env the operator sets."""
    args = ["torchrun", f"--nnodes={spec.num_nodes}", f"--nproc-per-node={spec.nproc_per_node}"]
    if spec.num_nodes > 1:
        args += ["--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)",
                 "--master-port=$(MASTER_PORT)"]
    else:
        args += ["--standalone"]
    return args + [str(a) for a in spec.headless_args(f"{CONFIG_MOUNT}/config.json")]


def pod_env(spec: JobSpec) -> list[dict]:
    """The container's env: PYTHONUNBUFFERED, then spec.env with `$` doubled for Kubernetes."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    return env + [{"name": k, "value": k8s_literal(v)} for k, v in spec.env.items()]


def object_meta(spec: JobSpec, name: str, labels: bool = False) -> dict:
    meta: dict = {"name": name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    if labels:
        meta["labels"] = {"app.kubernetes.io/created-by": "gpu_lab"}
    return meta


def _replica(spec: JobSpec, replicas: int) -> dict:
    g = int(spec.nproc_per_node)
    resources = ({"limits": {"nvidia.com/gpu": g}, "requests": {"nvidia.com/gpu": g}}
                 if spec.device == "cuda" else {"limits": {"cpu": spec.cpus_per_task}})
    container = {
        "name": "pytorch",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": pod_command(spec),
        "env": pod_env(spec),
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
               {"name": "config", "configMap": {"name": spec.name + "-config"}}]
    return {"replicas": replicas, "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], "volumes": volumes}}}


def pytorchjob_manifest(spec: JobSpec) -> dict:
    replicas = {"Master": _replica(spec, 1)}
    if spec.num_nodes > 1:
        replicas["Worker"] = _replica(spec, spec.num_nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": object_meta(spec, spec.name, labels=True),
        "spec": {"runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    }


def pytorchjob_yaml(spec: JobSpec) -> str:
    what = "GPU" if spec.device == "cuda" else "CPU process"
    return dump_yaml(f"# {spec.name}: {spec.num_nodes} pod(s) x {spec.nproc_per_node} {what}(s), "
                     f"{spec.entry} (exported by gpu_lab)\n"
                     f"# kubectl apply -f {CONFIGMAP_FILE} -f {JOB_FILE}\n" + _NOTES,
                     pytorchjob_manifest(spec))


def configmap_manifest(spec: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(spec, spec.name + "-config"),
            "data": {"config.json": spec.config_json()}}


def configmap_yaml(spec: JobSpec) -> str:
    return dump_yaml(f"# the TrainConfig every pod reads at {CONFIG_MOUNT}/config.json\n",
                     configmap_manifest(spec))


def kubernetes(spec: JobSpec) -> Export:
    n, g = spec.num_nodes, spec.nproc_per_node
    text = [
        f"A Kubeflow PyTorchJob with a Master pod{f' and {n - 1} Worker pod(s)' if n > 1 else ''}"
        f", each with {g} `nvidia.com/gpu` (the device plugin gives the container exactly those "
        "GPUs) and a memory-backed `/dev/shm` of "
        f"{spec.shm_size}: DataLoader workers pass batches through shared memory, and a "
        "container's default 64 MiB ends in 'bus error' at the first large batch.",
        "",
        "Kubeflow's training operator schedules GPU jobs with `nvidia.com/gpu` limits; for "
        "PyTorch it runs a PyTorchJob. It sets MASTER_ADDR, MASTER_PORT and RANK (the pod's "
        "index) in every pod; the container's torchrun uses them as rendezvous and node rank and "
        f"starts {g} rank(s) per pod, each running `gpu_lab.rank.headless {spec.entry}` with the "
        f"TrainConfig mounted from the ConfigMap at {CONFIG_MOUNT}/config.json.",
        "",
        f"The image ({spec.image}) must contain gpu_lab and the module of `{spec.entry}`. "
        "`restartPolicy: OnFailure` restarts a pod that died (torchrun reports a preempted rank "
        "as exit code 1, so an exit-code policy would not retry it); with resume=True and "
        "output_dir on a volume every pod mounts, the restart continues from the newest "
        "checkpoint.",
    ]
    files = {CONFIGMAP_FILE: configmap_yaml(spec), JOB_FILE: pytorchjob_yaml(spec),
             "config.json": spec.config_json()}
    return Export("kubernetes", f"kubectl apply -f {CONFIGMAP_FILE} -f {JOB_FILE}", files,
                  "\n".join(text), spec)
