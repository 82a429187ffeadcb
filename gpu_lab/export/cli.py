"""`gpu-lab export TARGET --entry MODULE:FUNCTION [--config cfg.json] [--out DIR] ...`, and
`gpu-lab export grafana [--out DIR]` (a dashboard, no training function)."""
from __future__ import annotations

import argparse
import os
import sys

JOB_TARGETS = ("torchrun", "accelerate", "slurm", "kubernetes", "trainjob", "all")
TARGET_CHOICES = (*JOB_TARGETS, "grafana")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="torchrun / accelerate / Slurm / Kubeflow files for a training function; "
                       "a Grafana dashboard",
        description="Write what a cluster needs to run MODULE:FUNCTION with a TrainConfig: a "
                    "torchrun or accelerate launch command, a Slurm sbatch script (SIGUSR1 before "
                    "the time limit, requeue on exit 143), a Kubeflow training-operator v1 "
                    "PyTorchJob (kubernetes) or a Kubeflow Trainer v2 TrainJob (trainjob). Every "
                    "rank runs `python -m gpu_lab.rank.headless`, which records the run in the "
                    "registry. `grafana` writes a Grafana dashboard (JSON) for the Prometheus "
                    "metrics of gpu_lab's Jupyter server and DCGM-exporter.",
        epilog="Values are written exactly as given: shell-quoted in commands and the sbatch "
               "script, by a YAML serializer in manifests. One exception, on purpose: a "
               "--master-addr or --env value that is exactly $NAME or ${NAME} is expanded by the "
               "shell on the node (quote it when you type it: --env 'DATA=$SCRATCH'); anything "
               "else with a $ (a$HOME, $(cmd), ${X:-y}) stays literal, and Kubernetes env values "
               "are always literal. Refused, with exit code 2 and the rule: control characters "
               "(newlines, tabs) in any value, and names that Slurm or Kubernetes would not "
               "accept as given (--name and --namespace: lower-case letters, digits and '-'; "
               "--partition, --account, --qos: letters, digits, '_', '.', '-').")
    p.add_argument("target", choices=TARGET_CHOICES, help="what to export")
    p.add_argument("--entry", metavar="MODULE:FUNCTION",
                   help="the training function, e.g. gpu_lab.train:train_classifier (every "
                        "target but grafana)")
    p.add_argument("--config", metavar="CONFIG.json",
                   help="TrainConfig JSON (default: TrainConfig's defaults)")
    p.add_argument("--out", metavar="DIR", help="write the files here (default: print them)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="processes per node, one per GPU (default: the config's num_processes, else 1)")
    p.add_argument("--name", help="job name: lower-case letters, digits and '-', at most 48 "
                                  "(default gpu-lab-<model>)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo ranks, no GPU request (to try a job on CPU nodes)")
    p.add_argument("--master-addr", default="$MASTER_ADDR",
                   help="rendezvous host for multi-node torchrun/accelerate: a host name, an "
                        "IPv4 address, or exactly $NAME / ${NAME}, expanded on each node "
                        "(default $MASTER_ADDR)")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port (default 29400)")
    p.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d")
    p.add_argument("--image", default="gpu-lab:latest", help="container image (Kubernetes)")
    p.add_argument("--shm-size", default="16Gi", help="/dev/shm size in the pod (Kubernetes)")
    p.add_argument("--namespace", help="Kubernetes namespace")
    p.add_argument("--runtime", help="TrainJob: the ClusterTrainingRuntime to run on (default "
                                     "torch-distributed, or gpu-lab-torch with --define-runtime)")
    p.add_argument("--define-runtime", action="store_true",
                   help="TrainJob: also write a ClusterTrainingRuntime for --image")
    p.add_argument("--time", dest="time_limit", default="24:00:00", help="Slurm time limit")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--qos", help="Slurm quality of service")
    p.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per rank (Slurm)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for every rank (repeatable); VALUE is literal "
                        "unless it is exactly $NAME or ${NAME}")
    p.add_argument("--no-check-import", action="store_true",
                   help="do not import MODULE here (it exists only on the cluster)")
    p.add_argument("--explain", action="store_true", help="also print the explanation")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.target == "grafana":
        return _grafana(args)
    if not args.entry:
        print(f"gpu-lab export {args.target}: --entry MODULE:FUNCTION is required (the training "
              "function, e.g. gpu_lab.train:train_classifier)", file=sys.stderr)
        return 2
    return _jobs(args)


def _grafana(args: argparse.Namespace) -> int:
    from .grafana import dashboard_json, write_dashboard

    if args.out:
        print(f"# grafana: wrote {write_dashboard(args.out)} (Dashboards > New > Import)")
    else:
        sys.stdout.write(dashboard_json())  # plain JSON, to pipe into a file or an API call
    return 0


def _jobs(args: argparse.Namespace) -> int:
    from ..config import TrainConfig
    from . import export
    from ..rank.address import EntryError

    # like `python -m`, find the user's module in the current directory
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            why = "its name (before '=') is empty" if sep else "it has no '='"
            print(f"gpu-lab export: --env: got {item!r}, but {why}; expected NAME=VALUE",
                  file=sys.stderr)
            return 2
        env[key] = value
    try:
        config = TrainConfig.from_json(open(args.config).read()) if args.config else TrainConfig()
        jobs = export(config, args.entry, target=args.target, out_dir=args.out,
                      num_nodes=args.nodes, nproc_per_node=args.gpus_per_node, name=args.name,
                      device=args.device, master_addr=args.master_addr, port=args.port,
                      rdzv_backend=args.rdzv_backend, image=args.image, shm_size=args.shm_size,
                      namespace=args.namespace, time_limit=args.time_limit,
                      partition=args.partition, account=args.account, qos=args.qos,
                      cpus_per_task=args.cpus_per_task, env=env, runtime=args.runtime,
                      define_runtime=args.define_runtime,
                      check_import=not args.no_check_import)
    except (EntryError, ValueError, TypeError, OSError) as exc:
        print(f"gpu-lab export: {exc}", file=sys.stderr)
        return 2
    jobs = jobs if isinstance(jobs, dict) else {args.target: jobs}
    for target, job in jobs.items():
        print(f"# {target}: {job.command}")
        if args.out:
            print(f"#   wrote {', '.join(job.files)} to {args.out}")
        else:
            for name, text in job.files.items():
                if name != "config.json" or target == "torchrun":
                    print(f"# ---- {name}\n{text}")
        if args.explain:
            print("\n".join(f"#   {line}" for line in job.explanation.splitlines()))
    return 0
