"""A Kubeflow PyTorchJob (training-operator, kubeflow.org/v1) and the ConfigMap with the config.

The operator creates one Master pod and `num_nodes - 1` Worker pods and gives each MASTER_ADDR,
MASTER_PORT, WORLD_SIZE (pods) and RANK (the pod's index, Master = 0). Each pod runs torchrun for
its GPUs with those as node rank and rendezvous address. The YAML is written by hand rather than
dumped, so that it keeps the comments that explain it; strings are JSON-quoted (valid YAML).
"""
from __future__ import annotations

import json

from .job import Export, JobSpec

JOB_FILE = "pytorchjob.yaml"
CONFIGMAP_FILE = "configmap.yaml"
CONFIG_MOUNT = "/etc/gpu_lab"


def _q(s: str) -> str:
    return json.dumps(str(s))


def pod_command(spec: JobSpec) -> list[str]:
    """torchrun inside a pod; $(VAR) is expanded by Kubernetes from the env the operator sets."""
    args = ["torchrun", f"--nnodes={spec.num_nodes}", f"--nproc-per-node={spec.nproc_per_node}"]
    if spec.num_nodes > 1:
        args += ["--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)",
                 "--master-port=$(MASTER_PORT)"]
    else:
        args += ["--standalone"]
    return args + spec.run_entry_args(f"{CONFIG_MOUNT}/config.json")


def _replica(spec: JobSpec, role: str, replicas: int) -> str:
    cmd = ", ".join(_q(a) for a in pod_command(spec))
    env = "".join(f"\n                - name: {_q(k)}\n                  value: {_q(v)}"
                  for k, v in spec.env.items())
    gpu = (f"\n                limits:\n                  nvidia.com/gpu: {spec.nproc_per_node}"
           f"  # one per rank\n                requests:\n                  nvidia.com/gpu: "
           f"{spec.nproc_per_node}" if spec.device == "cuda" else
           f"\n                limits:\n                  cpu: {spec.cpus_per_task}")
    return f"""    {role}:
      replicas: {replicas}
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch  # the operator looks for this container name
              image: {_q(spec.image)}
              imagePullPolicy: IfNotPresent
              command: [{cmd}]
              env:
                - name: "PYTHONUNBUFFERED"
                  value: "1"{env}
              resources:{gpu}
              volumeMounts:
                - name: dshm
                  mountPath: /dev/shm
                - name: config
                  mountPath: {_q(CONFIG_MOUNT)}
                  readOnly: true
          volumes:
            - name: dshm  # shared memory for DataLoader workers and NCCL (a container gets 64 MiB)
              emptyDir:
                medium: Memory
                sizeLimit: {_q(spec.shm_size)}
            - name: config
              configMap:
                name: {_q(spec.name + "-config")}
"""


def pytorchjob_yaml(spec: JobSpec) -> str:
    ns = f"\n  namespace: {_q(spec.namespace)}" if spec.namespace else ""
    out = f"""# {spec.name}: {spec.num_nodes} pod(s) x {spec.nproc_per_node} \
{'GPU' if spec.device == 'cuda' else 'CPU process'}(s), {spec.entry} (exported by gpu_lab)
# kubectl apply -f {CONFIGMAP_FILE} -f {JOB_FILE}
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {_q(spec.name)}{ns}
  labels:
    app.kubernetes.io/created-by: "gpu_lab"
spec:
  runPolicy:
    backoffLimit: 3        # pod restarts (preemption, node loss) before the job fails
    cleanPodPolicy: None   # keep finished pods so their logs can be read
  pytorchReplicaSpecs:
"""
    out += _replica(spec, "Master", 1)
    if spec.num_nodes > 1:
        out += _replica(spec, "Worker", spec.num_nodes - 1)
    return out


def configmap_yaml(spec: JobSpec) -> str:
    ns = f"\n  namespace: {_q(spec.namespace)}" if spec.namespace else ""
    body = "\n".join("    " + line for line in spec.config_json().rstrip("\n").splitlines())
    return f"""# the TrainConfig every pod reads at {CONFIG_MOUNT}/config.json
apiVersion: v1
kind: ConfigMap
metadata:
  name: {_q(spec.name + "-config")}{ns}
data:
  config.json: |
{body}
"""


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
        f"starts {g} rank(s) per pod, each running `gpu_lab.run_entry {spec.entry}` with the "
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
