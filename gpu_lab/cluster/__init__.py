"""Runs on a cluster's scheduler (Slurm): its commands (`slurm`), the table from its job states to
gpu_lab's statuses (`states`), a submitted run's batch script (`script`), its supervisor inside
the job (`job`), the follower that writes what only the scheduler knows (`follow`), the ranks a
job lost with a node (`lost`), and a private cluster to try it on (`sandbox`: one node, or two on
private hosts). gpu_lab.submit (gpu_lab.launch.submit) is the entry.
"""
from __future__ import annotations

from gpu_lab._lazy import lazy_api

__getattr__, __dir__, __all__ = lazy_api(__name__, {
    "PrivateSlurm": ".sandbox", "Hosts": ".sandbox", "SlurmError": ".slurm", "JobState": ".slurm",
    "status_of": ".states"})
