"""torchrun commands: one node (`--standalone`), or several nodes meeting at a c10d rendezvous.

The command line is built from shell words (gpu_lab.export.quoting): environment variables come
first as `NAME='value'` assignments, every value reaches torchrun exactly as given, and only a
value that is exactly `$NAME` / `${NAME}` (the default master_addr, $MASTER_ADDR) is expanded by
the shell of the node that runs the command.
"""
from __future__ import annotations

from .job import Export, JobSpec
from .quoting import Ref, Word, env_assignment, shell_join, value


def torchrun_argv(spec: JobSpec, torchrun: str = "torchrun",
                  config_path: str | None = None) -> list[Word]:
    """The torchrun words for `spec`: strings, or tuples of parts where a part may be a shell
    reference (quoting.Ref, e.g. $MASTER_ADDR); quoting.shell_join makes the command line."""
    g = int(spec.nproc_per_node)
    addr = value(spec.master_addr)
    argv: list[Word] = [torchrun]
    if spec.num_nodes == 1:
        # a private rendezvous on a free local port: no address, no port clash with other jobs
        argv += ["--standalone", "--nnodes=1", f"--nproc-per-node={g}"]
    elif spec.rdzv_backend == "c10d":
        argv += [f"--nnodes={spec.num_nodes}", f"--nproc-per-node={g}", "--rdzv-backend=c10d",
                 ("--rdzv-endpoint=", addr, f":{spec.port}"), f"--rdzv-id={spec.name}"]
    else:  # static: every node states its rank
        argv += [f"--nnodes={spec.num_nodes}", f"--nproc-per-node={g}",
                 ("--node-rank=", Ref("${NODE_RANK}")), ("--master-addr=", addr),
                 f"--master-port={spec.port}"]
    return argv + spec.headless_args(config_path)


def torchrun(spec: JobSpec) -> Export:
    """The torchrun command that runs `spec.entry` with its config on every rank."""
    env = [env_assignment(k, v) for k, v in spec.env.items()]
    command = shell_join(env + torchrun_argv(spec))
    g, n = spec.nproc_per_node, spec.num_nodes
    per = "GPU" if spec.device == "cuda" else "CPU process"
    prec = spec.config.mixed_precision
    lines = [
        f"torchrun starts {g} process{'es' if g > 1 else ''} on "
        f"{'this node' if n == 1 else f'each of {n} nodes'} (one per {per}; {spec.world_size} "
        "ranks in all) and gives each its RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT. Each rank runs `python -m gpu_lab.rank.headless "
        f"{spec.entry} --config {spec.config_path}`: it loads the TrainConfig, calls "
        f"`{spec.function_name}(config)`, and writes its metrics, status and errors into the run "
        "registry, where `gpu_lab.runs()` and the JupyterLab panel show them next to notebook "
        "runs. No kernel has to listen.",
        "",
        "A typical launch is `torchrun --nproc_per_node=8 train.py --precision bf16`. Here "
        f"the precision is part of `{spec.config_path}` (mixed_precision={prec!r}), so the "
        "notebook, this command and the cluster files all read one config and cannot disagree.",
    ]
    if n == 1:
        lines += ["", "`--standalone` makes a private rendezvous on a free local port: two jobs "
                      "on one machine do not collide on port 29500."]
    elif spec.rdzv_backend == "c10d":
        lines += ["", f"Run the same command on all {n} nodes, with MASTER_ADDR set to the first "
                      f"node's address. The c10d rendezvous on {spec.master_addr}:{spec.port} "
                      "(node 0 hosts it) gives every node its rank, so no node needs a "
                      f"--node-rank; `--rdzv-id={spec.name}` keeps this job apart from others on "
                      "the same endpoint. Open the port between the nodes."]
    else:
        lines += ["", f"Run the same command on all {n} nodes with NODE_RANK set to 0..{n - 1} "
                      "(0 on the master) and MASTER_ADDR set to node 0's address."]
    files = {"config.json": spec.config_json()}
    return Export("torchrun", command, files, "\n".join(lines), spec)
