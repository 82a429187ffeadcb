"""A Slurm batch script: srun starts one task per GPU, SIGUSR1 before the time limit, requeue.

Why srun and not torchrun inside the job: Slurm's `--signal=SIGUSR1@90` goes to the processes of
the job steps. torchrun's agent does not handle SIGUSR1 (its default action ends the agent and
orphans the ranks) and, when its ranks exit with 143, it exits with 1, hiding the preemption.
With srun starting the ranks directly, every rank gets SIGUSR1, the training toolkit's
PreemptionGuard checkpoints at the next step boundary and exits 143, srun returns the highest
task exit code (143), and the script requeues the job; on the next start, fit() resumes from the
newest complete checkpoint (TrainConfig.resume). This is also how Lightning runs on Slurm.

What the script holds: #SBATCH values are checked names, numbers and time formats (no spaces,
quotes or '#', so no directive can split or end early; sbatch_script refuses one that would);
environment values and the command's words are shell-quoted by gpu_lab.export.quoting, so they
reach srun and every rank exactly as given (a value that is exactly `$NAME` or `${NAME}` is
expanded by the job's shell).
"""
from __future__ import annotations

import re

from ..rank.outcome import STOP_EXIT_CODE  # torch-free: an export never imports torch
from .job import Export, JobSpec
from .quoting import env_assignment, shell_join, value

SCRIPT = "train.sbatch"
SIGNAL_LEAD_S = 90       # seconds before the time limit: enough for one step and one checkpoint
# what an #SBATCH option may hold: sbatch splits a directive at whitespace, reads quotes and stops
# at '#', so anything else would change what the option says
_DIRECTIVE = re.compile(r"--[a-z-]+(=[A-Za-z0-9_.,:@%=/+-]+)?")


def _directive(option: str) -> str:
    if _DIRECTIVE.fullmatch(option) is None:
        raise ValueError(f"sbatch: the directive {option!r} would not reach Slurm intact; "
                         "accepted values: letters, digits and _.,:@%=/+-")
    return f"#SBATCH {option}"


def directives(spec: JobSpec, requeue: bool = True, output: str | None = "%x-%j.out") -> list[str]:
    """The #SBATCH lines (with a comment line above those that need one) for `spec`: the nodes,
    one task per rank, the time limit, the checkpoint signal before it, and where the log goes."""
    g, n = int(spec.nproc_per_node), spec.num_nodes
    sb: list[tuple[str, str]] = [
        (f"--job-name={spec.name}", ""),
        (f"--nodes={n}", ""),
        (f"--ntasks-per-node={g}", "one task = one rank; srun starts them"),
    ]
    if spec.device == "cuda":
        sb.append((f"--gres=gpu:{g}", "GPUs per node, one per task"))
    sb += [(f"--cpus-per-task={spec.cpus_per_task}", "DataLoader workers + the main thread"),
           (f"--time={spec.time_limit}", ""),
           (f"--signal=SIGUSR1@{SIGNAL_LEAD_S}",
            f"{SIGNAL_LEAD_S} s before the time limit: checkpoint, exit {STOP_EXIT_CODE}")]
    sb += [("--requeue", "the job may be put back in the queue"),
           ("--open-mode=append", "a requeued run appends to the same log")] if requeue \
        else [("--no-requeue", "a preempted job ends, it does not come back")]
    if output:
        sb.append((f"--output={output}", ""))
    if spec.partition:
        sb.append((f"--partition={spec.partition}", ""))
    if spec.account:
        sb.append((f"--account={spec.account}", ""))
    if spec.qos:
        sb.append((f"--qos={spec.qos}", ""))
    # comments on lines of their own: sbatch reads every word after #SBATCH as an option
    lines = []
    for option, comment in sb:
        if comment:
            lines.append(f"# {comment}")
        lines.append(_directive(option))
    return lines


# Rendezvous for torch.distributed: the job's first node, a port derived from the job id so that
# two jobs sharing a node do not collide.
RENDEZVOUS = """\
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"""


def sbatch_script(spec: JobSpec) -> str:
    g, n = int(spec.nproc_per_node), spec.num_nodes
    env = [shell_join(["export", env_assignment(k, v)]) for k, v in spec.env.items()]
    run = shell_join(["srun", value(spec.python)] + spec.headless_args())
    body = f"""#!/bin/bash
# {spec.name}: {n} node(s) x {g} {'GPU' if spec.device == 'cuda' else 'CPU task'}(s), \
{spec.entry} (exported by gpu_lab)
{chr(10).join(directives(spec))}

set -u
# gpu_lab.rank.headless maps SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS / SLURM_NODEID to
# RANK / LOCAL_RANK / WORLD_SIZE / GROUP_RANK.
{RENDEZVOUS}
# The run registry is SQLite (WAL): keep GPU_LAB_HOME on a local disk, not NFS, on multi-node jobs.
{chr(10).join(env)}
echo "gpu_lab: job $SLURM_JOB_ID attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"

{run}
rc=$?
if [ "$rc" -eq {STOP_EXIT_CODE} ]; then
    # the PreemptionGuard saved a checkpoint and exited {STOP_EXIT_CODE}: run again later, resume
    echo "gpu_lab: job $SLURM_JOB_ID preempted (exit {STOP_EXIT_CODE}); requeueing" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$rc"
"""
    return body.replace("\n\n\n", "\n\n")


def slurm(spec: JobSpec) -> Export:
    g, n = spec.nproc_per_node, spec.num_nodes
    text = [
        f"`sbatch {SCRIPT}` asks Slurm for {n} node(s) with {g} "
        f"{'GPU' if spec.device == 'cuda' else 'task'}(s) each for {spec.time_limit}. srun "
        f"starts one task per GPU ({spec.world_size} ranks); each runs `python -m "
        f"gpu_lab.rank.headless {spec.entry} --config {spec.config_path}`, which turns Slurm's task "
        "ids into torch.distributed's ranks and records the run in the registry as "
        "`slurm-<job id>`.",
        "",
        f"The part of a Slurm job that saves work is the end of a "
        f"time slot: `--signal=SIGUSR1@{SIGNAL_LEAD_S}` sends SIGUSR1 to every rank "
        f"{SIGNAL_LEAD_S} s before the limit; the training toolkit's PreemptionGuard finishes "
        f"the step, writes a checkpoint and exits {STOP_EXIT_CODE}; srun returns "
        f"{STOP_EXIT_CODE}; the script calls `scontrol requeue`, and the next attempt "
        "resumes from the newest complete checkpoint (resume=True in the config; output_dir "
        "must be on storage every node sees). A scheduler preemption (SIGTERM) takes the same "
        "path.",
        "",
        "srun starts the ranks itself instead of torchrun: torchrun's agent would die of "
        "SIGUSR1 and turns the ranks' 143 into its own exit code 1.",
    ]
    files = {SCRIPT: sbatch_script(spec), "config.json": spec.config_json()}
    return Export("slurm", f"sbatch {SCRIPT}", files, "\n".join(text), spec)
