"""The batch script of a submitted run: the exported one's directives, then the run's job
supervisor (gpu_lab.cluster.job) instead of a bare srun, so the job records itself into the run
that gpu_lab.submit made and decides its own end (succeeded, failed, stopped, requeued)."""
from __future__ import annotations

from ..export.job import JobSpec
from ..export.quoting import env_assignment, shell_join, value
from ..export.slurm import RENDEZVOUS, directives


def job_script(spec: JobSpec, run_id: str, run_dir: str, requeue: bool) -> str:
    """The script sbatch gets. The log (--output) is given on sbatch's command line, where a path
    needs no quoting rules of its own."""
    g, n = int(spec.nproc_per_node), spec.num_nodes
    env = [shell_join(["export", env_assignment(k, v)]) for k, v in spec.env.items()]
    job = shell_join(["exec", value(spec.python), "-m", "gpu_lab.cluster.job", run_dir])
    body = f"""#!/bin/bash
# {spec.name}: gpu_lab run {run_id}, {n} node(s) x {g} \
{'GPU' if spec.device == 'cuda' else 'CPU task'}(s), {spec.entry} (submitted by gpu_lab.submit)
{chr(10).join(directives(spec, requeue=requeue, output=None))}

set -u
{RENDEZVOUS}
{chr(10).join(env)}
# the job's supervisor: records the run on this node, starts the ranks with srun, decides the end
{job}
"""
    return body.replace("\n\n\n", "\n\n")
