"""The ranks a job lost with a node: which of the job's nodes went silent (Slurm finds it down or
not answering, or its slurmd takes no connection), and each rank that ran there written as the
run's failure (category "node lost", the node named), where no rank there could write one. The
job's supervisor asks when srun fails; the follower asks when Slurm ended the job NODE_FAIL and
the job could not say so (the node it ran on was the one lost)."""
from __future__ import annotations

from ..failures.triage import node_lost
from ..record.runfolder import RunFolder
from . import slurm


def record_lost_ranks(folder: RunFolder, nodelist: str | None, ranks_per_node: int,
                      write: bool = True) -> dict:
    """{node: state} of the job's lost nodes: nodes none of whose ranks said why they ended,
    which Slurm finds down or not answering, or whose slurmd takes no connection. Their ranks'
    failures are written into `folder` unless write=False, for a job going back in the queue
    (srun's block order: the i-th node runs ranks i*ranks_per_node ...). Nothing lost: {}."""
    names = slurm.hostnames(nodelist)
    ranks = {node: range(i * ranks_per_node, (i + 1) * ranks_per_node)
             for i, node in enumerate(names)}
    silent = [node for node in names if not any(folder.has_error(r) for r in ranks[node])]
    if not silent:
        return {}
    lost = slurm.lost_nodes(",".join(silent))
    for node in silent:
        if node not in lost and (why := slurm.slurmd_silent(node)):
            lost[node] = why
    for node in lost if write else ():
        for rank in ranks.get(node, ()):
            folder.write_error(rank, node_lost(rank, node, lost[node]).to_dict())
    return lost


def lost_sentence(lost: dict, requeued: bool = False) -> str:
    """The run's reason when nodes were lost."""
    names = ", ".join(f"{node} ({state})" for node, state in lost.items())
    then = ("Slurm requeues the job: it resumes from its checkpoint when the nodes it needs are "
            "back" if requeued else "resume the run once the node is back")
    return f"lost node{'s' if len(lost) > 1 else ''} {names}: the ranks there ended with it; {then}"
