"""Multi-node launches: one gpu_lab.launch() call per node, all meeting at one rendezvous.

accelerate's notebook_launcher covers one node well, but two of its multi-node paths do not
rendezvous: with one process per node (`num_processes=1`) it calls the function in place, so two
"nodes" train alone with world size 1; and with `rdzv_backend="c10d"` it leaves the rendezvous
endpoint empty, so torch falls back to localhost:29400 on every node. For `num_nodes > 1` the
supervisor calls torch's elastic launcher directly, as notebook_launcher does for one node (same
environment, fork start, the function itself as the entry point), with the endpoint set to
`master_addr:port` for both backends.

Each node's launch is a run of its own: its own record, recorder and channel keys. Its ranks
inherit the recorder's address and the run's client key from the supervisor's environment (fork
start), as on one node; the channel is CURVE over TCP, so it can cross hosts as it is.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable


def rendezvous_config(backend: str, node_rank: int) -> dict[str, Any]:
    """static: each node states its rank. c10d: node 0 hosts the store (the master's address is
    node 0's), the others connect; ranks come from the order in which nodes join."""
    if backend == "static":
        return {"rank": node_rank}
    if backend == "c10d":
        return {"is_host": node_rank == 0}
    raise ValueError(f"rdzv_backend: got {backend!r}; accepted: 'static', 'c10d'")


def launch_nodes(entry: Callable, args: tuple, *, num_processes: int, num_nodes: int,
                 node_rank: int, master_addr: str, port: int, rdzv_backend: str,
                 mixed_precision: str) -> None:
    """Start this node's `num_processes` ranks of a `num_nodes`-node job and block until they end.

    Raises torch's ChildFailedError when a rank fails, like notebook_launcher.
    """
    from accelerate.utils import patch_environment
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env = dict(nproc=num_processes, node_rank=node_rank, world_size=num_nodes * num_processes,
               master_addr=master_addr, master_port=str(port),
               accelerate_mixed_precision=mixed_precision)
    with patch_environment(**env):
        kw: dict[str, Any] = {}
        has_numa = any(f.name == "numa_options" for f in fields(LaunchConfig))
        if has_numa:
            # Without numa_options, LaunchConfig asks torch.accelerator.is_available(), which
            # initialises CUDA here in the supervisor: every forked rank would then be in CUDA's
            # bad-fork state. Pass a value, then clear it (what notebook_launcher does).
            from torch.numa.binding import AffinityMode, NumaOptions

            kw["numa_options"] = NumaOptions(AffinityMode.NODE)
        config = LaunchConfig(
            min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes,
            run_id=f"gpu_lab-{port}",  # the same on every node: the port names the job
            rdzv_endpoint=f"{master_addr}:{port}", rdzv_backend=rdzv_backend,
            rdzv_configs=rendezvous_config(rdzv_backend, node_rank),
            max_restarts=0, monitor_interval=0.1, start_method="fork", **kw)
        if has_numa:
            config.numa_options = None
        elastic_launch(config=config, entrypoint=entry)(*args)
