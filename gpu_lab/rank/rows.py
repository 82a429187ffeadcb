"""A headless run's place and its row: where a rank sits (torchrun, srun, or alone), the run's
id (the same on every local rank without any exchange), and its row and Recorder in the registry.
Shared by `python -m gpu_lab.rank.headless` and a tracker that records a run gpu_lab did not
start (gpu_lab.rank.standalone).
"""
from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..record.events import ACTIVE_STATUSES


@dataclass
class Topology:
    """Where this process sits in the job, from the launcher's environment."""

    launcher: str          # "torchrun" | "slurm" | "python"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    launcher_pid: int      # torchrun's agent; this process under srun or alone

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0


def _int_env(env: dict, key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def detect_topology(env: dict | None = None) -> Topology:
    """Read the rank layout that torchrun or srun set. Under srun (no torchrun), set the
    variables torch.distributed and accelerate read (RANK, LOCAL_RANK, WORLD_SIZE, ...) from
    Slurm's, in `env` (os.environ by default)."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env and "RANK" in env and "WORLD_SIZE" in env:
        world = _int_env(env, "WORLD_SIZE")
        local_world = _int_env(env, "LOCAL_WORLD_SIZE", world)
        rank = _int_env(env, "RANK")
        nodes = _int_env(env, "GROUP_WORLD_SIZE", max(1, world // max(1, local_world)))
        node = _int_env(env, "GROUP_RANK", _int_env(env, "NODE_RANK", rank // max(1, local_world)))
        return Topology("torchrun", rank, _int_env(env, "LOCAL_RANK"), world, local_world, node,
                        nodes, os.getppid())
    # Only inside an srun step (SLURM_STEP_NUM_TASKS): the batch script itself also sees
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, and must not wait for ranks that no one
    # started.
    if "SLURM_PROCID" in env and _int_env(env, "SLURM_STEP_NUM_TASKS", 1) > 1:
        world = _int_env(env, "SLURM_STEP_NUM_TASKS")
        nodes = _int_env(env, "SLURM_STEP_NUM_NODES", _int_env(env, "SLURM_NNODES", 1))
        if world % nodes:
            raise ValueError(f"SLURM_STEP_NUM_TASKS={world} is not a multiple of the step's "
                             f"{nodes} node(s): use --ntasks-per-node (one task per GPU) so "
                             "every node runs as many ranks")
        if nodes > 1 and not env.get("MASTER_ADDR"):
            raise ValueError("running under srun on several nodes, but MASTER_ADDR is not set: "
                             "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
                             "| head -n 1) in the batch script (the exported one does)")
        rank, local = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_LOCALID")
        node = _int_env(env, "SLURM_NODEID", 0)
        env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world // nodes), "GROUP_RANK": str(node),
                    "NODE_RANK": str(node)})
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(29500 + _int_env(env, "SLURM_JOB_ID", 0) % 1000))
        return Topology("slurm", rank, local, world, world // nodes, node, nodes, os.getpid())
    return Topology("python", 0, 0, 1, 1, 0, 1, os.getpid())


def derive_run_id(topo: Topology, explicit: str | None = None, env: dict | None = None) -> str:
    """The registry id of this node's run, the same on every local rank without any exchange:
    `--run-id`, else `slurm-<job id>` (a requeued job continues its row), else a timestamp and a
    hash of the launcher process (host, pid, start time). Nodes after the first get `-node<k>`."""
    env = os.environ if env is None else env
    if explicit:
        base = explicit
    elif topo.launcher == "slurm" and env.get("SLURM_JOB_ID"):
        base = f"slurm-{env['SLURM_JOB_ID']}"
    else:
        import psutil

        try:
            started = psutil.Process(topo.launcher_pid).create_time()
        except psutil.Error:
            started = 0.0
        digest = hashlib.sha1(f"{socket.gethostname()}:{topo.launcher_pid}:{started:.3f}"
                              .encode()).hexdigest()[:6]
        base = time.strftime("%Y%m%d-%H%M%S-", time.localtime(started or time.time())) + digest
    return base if topo.num_nodes == 1 or topo.node_rank == 0 else f"{base}-node{topo.node_rank}"


def start_recording(registry: Any, run_id: str, folder: Any) -> tuple[Any, Any]:
    """This rank's own recorder, and gpu_lab.report pointed at it. The recorder makes its own
    channel key: it never leaves this process and its children (DataLoader workers report too),
    and no other process needs it (nothing publishes)."""
    from ..record import events as ev
    from ..record import reporter as rep
    from ..record.channel import ENV_KEY
    from ..record.recorder import Recorder

    recorder = Recorder(registry, run_id, publish=False)
    os.environ.update({ev.ENV_RUN_ID: run_id, ev.ENV_ADDRESS: recorder.address,
                       ENV_KEY: recorder.client_key.encode(), ev.ENV_RUN_DIR: str(folder.path)})
    rep.reset_reporter()
    return recorder, rep.get_reporter()


def open_row(registry: Any, run_id: str, topo: Topology, config: Any, run_dir: Path,
              name: str) -> None:
    """Create this node's row, or revive it (a torchrun restart, a Slurm requeue)."""
    import psutil

    try:
        started = psutil.Process(topo.launcher_pid).create_time()
    except psutil.Error:
        started = None
    if registry.get_run(run_id) is None:
        registry.create_run(run_id, name=name, config=config.to_dict() if config else None,
                            num_processes=topo.local_world_size, num_nodes=topo.num_nodes,
                            node_rank=topo.node_rank, run_dir=str(run_dir),
                            output_dir=config.output_dir if config else None, kind=topo.launcher,
                            status="running")
    registry.update(run_id, status="running", ended=None, error=None, host=socket.gethostname(),
                    pid=topo.launcher_pid, pgid=None, pid_started=started)


def close_row(registry: Any, run_id: str, topo: Topology, status: str, error: str | None) -> None:
    """Record this rank's outcome in the node's row. A failure on any rank wins (the first one
    keeps its message: a dead rank makes the others fail with "connection closed"); a stop (a
    preemption, or torchrun ending the other ranks after one failed) never hides a failure; a
    success is local rank 0's word and only ends a row that is still active."""
    if status == "failed":
        row = registry.get_run(run_id)
        if row is None or row["status"] != "failed":  # the first failure is the root cause;
            # the others follow from it; it also replaces a 'stopped' that torchrun's ending of
            # the surviving ranks wrote first
            registry.set_status(run_id, "failed", error=error, overwrite=True)
        return
    if status == "succeeded" and not topo.is_node_leader:
        return
    row = registry.get_run(run_id)
    if row is not None and row["status"] in ACTIVE_STATUSES:
        registry.set_status(run_id, status, error=error)
