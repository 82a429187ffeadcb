"""The ranks a job lost with a node: which of the job's nodes Slurm finds down or not answering,
and each rank that ran there written as the run's failure (category "node lost", the node named),
where the rank could not write one itself. The job's supervisor asks when srun fails; the
follower asks when Slurm ended the job NODE_FAIL and the job could not say so (the node it ran
on was the one lost)."""
from __future__ import annotations

from ..failures.triage import node_lost
from ..record.runfolder import RunFolder
from . import slurm


def record_lost_ranks(folder: RunFolder, nodelist: str | None, ranks_per_node: int) -> dict:
    """{node: state} of the lost nodes; their ranks' failures written into `folder` (srun's
    block order: the i-th node runs ranks i*ranks_per_node ...). Nothing lost: {}."""
    lost = slurm.lost_nodes(nodelist)
    if not lost:
        return {}
    for i, node in enumerate(slurm.hostnames(nodelist)):
        if node not in lost:
            continue
        for rank in range(i * ranks_per_node, (i + 1) * ranks_per_node):
            if not folder.has_error(rank):  # a rank that said why keeps its word
                folder.write_error(rank, node_lost(rank, node, lost[node]).to_dict())
    return lost


def lost_sentence(lost: dict) -> str:
    """The run's reason when nodes were lost."""
    names = ", ".join(f"{node} ({state})" for node, state in lost.items())
    return (f"lost node{'s' if len(lost) > 1 else ''} {names}: the ranks there ended with "
            "it; resume the run once the node is back")
