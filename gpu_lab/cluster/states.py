"""Slurm's job states as gpu_lab's run statuses: the one table.

| Slurm state | gpu_lab status | reason shown |
|---|---|---|
| PENDING, REQUEUED, REQUEUE_HOLD, REQUEUE_FED, RESV_DEL_HOLD, SUSPENDED | queued | Slurm's reason, with advice |
| CONFIGURING, RUNNING, COMPLETING, STAGE_OUT, SIGNALING, RESIZING, STOPPED | running | |
| COMPLETED | succeeded | |
| FAILED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE, SPECIAL_EXIT | failed | what failed, and what to try |
| CANCELLED after the Run's stop | stopped | the stop's reason (the ranks checkpointed) |
| CANCELLED otherwise | stopped | cancelled in Slurm |
| TIMEOUT | stopped | the time limit (the ranks checkpointed at the signal before it) |
| PREEMPTED | stopped | preempted; a requeued job shows PENDING next, so queued again |

The job records its own end when it can (gpu_lab.cluster.job): that word wins. This table decides
the end only of jobs that could not say it themselves (cancelled while pending, a node that
failed, a job killed at its limit or for memory), and what `queued` and `running` mean while the
job lives. Kubernetes' phases would get a table of the same shape.
"""
from __future__ import annotations

QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
RUNNING = ("CONFIGURING", "RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING", "STOPPED")
SUCCEEDED = ("COMPLETED",)
FAILED = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT")
STOPPED = ("CANCELLED", "TIMEOUT", "PREEMPTED")
FINAL = SUCCEEDED + FAILED + STOPPED

# What a pending job waits for, in words a user can act on (Slurm's reason codes otherwise).
_WAITING = {
    "Resources": "the nodes it asks for are busy",
    "Priority": "jobs of higher priority go first",
    "Dependency": "it waits for the jobs it depends on",
    "BeginTime": "its start time has not come; Slurm holds a requeued job about two minutes",
    "JobHeldUser": "held by you: `scontrol release <job id>`",
    "JobHeldAdmin": "held by an administrator",
    "ReqNodeNotAvail": "a node it needs is down or reserved",
    "PartitionTimeLimit": "its time limit exceeds the partition's: submit with a shorter time_limit",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionDown": "its partition is down",
    "QOSMaxJobsPerUserLimit": "you run as many jobs as your QOS allows: it starts when one ends",
    "AssocGrpGRES": "your account's GPU share is in use: it starts when some is free",
    "AssocMaxJobsLimit": "your account runs as many jobs as it may",
    "BadConstraints": "no node matches what it asks for: check nodes, GPUs and memory",
    "PartitionConfig": "it asks for more than the partition's nodes have (CPUs per task x tasks, "
                       "GPUs, memory): it will never start; cancel it and ask for less",
}
_FAILED = {
    "NODE_FAIL": "a node of the job failed; resume the run from its last checkpoint",
    "OUT_OF_MEMORY": "Slurm ended it for using more host memory than it asked for: ask for "
                     "more (sbatch --mem), or lower batch_size or num_workers",
    "BOOT_FAIL": "its node failed to start; submit again",
    "DEADLINE": "it could not finish before its deadline",
    "SPECIAL_EXIT": "it was held after a requeue; release it with `scontrol release`",
    "FAILED": "its batch script failed: see the run's supervisor log",
}


def status_of(state: str, reason: str | None = None, *,
              stop_reason: str | None = None) -> tuple[str, str | None]:
    """(gpu_lab status, reason) for a job in Slurm state `state` with Slurm's `reason`;
    `stop_reason`: the reason of a stop the Run asked for (its control/stop request), if any.
    An unknown state reads as running: Slurm adds states, and the job still holds its place."""
    state = state.split()[0].rstrip("+") if state else ""
    if state in QUEUED:
        return "queued", waiting(reason, state)
    if state in SUCCEEDED:
        return "succeeded", None
    if state in FAILED:
        return "failed", f"Slurm: {state}: {_FAILED[state]}"
    if state == "CANCELLED":
        return "stopped", stop_reason or "cancelled in Slurm (scancel, or an administrator)"
    if state == "TIMEOUT":
        return "stopped", ("reached its time limit; the ranks checkpointed at the signal before "
                           "it: resume the run to go on")
    if state == "PREEMPTED":
        return "stopped", "preempted by Slurm; resume the run to go on"
    return "running", None


def waiting(reason: str | None, state: str = "PENDING") -> str:
    """A pending job's reason, with what it means."""
    if state == "SUSPENDED":
        return "suspended by Slurm: it goes on when resumed"
    if state != "PENDING":
        return "requeued by Slurm: it resumes from its checkpoint when it starts again"
    if not reason or reason == "None":
        return "waiting in Slurm's queue"
    return f"waiting in Slurm's queue: {reason} ({_WAITING[reason]})" if reason in _WAITING \
        else f"waiting in Slurm's queue: {reason}"
