"""Multi-node: two "nodes" on 127.0.0.1, one process each, meeting at one c10d rendezvous.

From the notebook: two separate gpu_lab.launch calls (as a user would run the same cell on two
machines). Headless: the exported multi-node torchrun command, run twice. Either way they must form
one group of world size 2, and the registry must show one row per node with its node rank. From
the notebook, node 0's run holds every rank's events (tests/test_multinode_record.py).
"""
from __future__ import annotations

import subprocess

import pytest

import gpu_lab
from gpu_lab.export import export
from gpu_lab.launch import free_port
from gpu_lab.record.registry import Registry

import export_fns
from job_utils import job_env

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


@pytest.mark.timeout(600)
def test_two_nodes_one_process_each_rendezvous_with_c10d():
    cfg = gpu_lab.TrainConfig(max_steps=4)
    kw = dict(num_processes=1, num_nodes=2, master_addr="127.0.0.1", port=free_port(),
              rdzv_backend="c10d", config=cfg)
    node0 = gpu_lab.launch(export_fns.train_tiny, cfg, node_rank=0, name="node0", **kw)
    node1 = gpu_lab.launch(export_fns.train_tiny, cfg, node_rank=1, name="node1", **kw)
    try:
        for run in (node0, node1):
            assert run.wait(180) == "succeeded", (run.logs(None, 40), run.logs(0, 40),
                                                  run.logs(1, 40))
    finally:
        for run in (node0, node1):
            run.stop(grace=1.0)
    res = node0.result()  # global rank 0 runs on node 0
    assert (res["world_size"], res["distributed_type"], res["node_rank"]) == (2, "MULTI_CPU", 0)
    p0, p1 = res["params"]
    assert p0 == pytest.approx(p1, abs=1e-7), "the nodes trained separate models"
    assert node1.result() is None  # node 1 holds global rank 1 only
    reg = Registry()
    rows = {r: reg.get_run(run.id) for r, run in ((0, node0), (1, node1))}
    for node_rank, row in rows.items():
        assert (row["num_nodes"], row["node_rank"], row["num_processes"], row["status"]) == \
            (2, node_rank, 1, "succeeded")
    # one record: node 0's recorder has both ranks; node 1's row points at node 0's run
    assert {m["rank"] for m in reg.metrics(node0.id, "loss")} == {0, 1}
    assert reg.metrics(node1.id, "loss") == []
    assert rows[1]["part_of"]["run"] == node0.id and rows[0]["part_of"] is None


@pytest.mark.timeout(600)
def test_exported_multinode_torchrun_command_on_two_nodes(tmp_path):
    job = export(gpu_lab.TrainConfig(max_steps=3), "export_fns:train_tiny", "torchrun",
                 num_nodes=2, nproc_per_node=1, port=free_port(), out_dir=tmp_path)
    env = job_env(tmp_path / "home")
    env["MASTER_ADDR"] = "127.0.0.1"  # what each node's shell would export
    # the same command line on both "nodes", through a shell that expands $MASTER_ADDR
    nodes = [subprocess.Popen(["bash", "-c", job.command], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(2)]
    logs = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    reg = Registry(tmp_path / "home" / "registry.db")
    rows = sorted(reg.list_runs(), key=lambda r: r["node_rank"])
    assert [(r["node_rank"], r["num_nodes"], r["status"], r["kind"]) for r in rows] == \
        [(0, 2, "succeeded", "torchrun"), (1, 2, "succeeded", "torchrun")]
    assert rows[1]["id"].endswith("-node1")
    assert [sorted({m["rank"] for m in reg.metrics(r["id"], "loss")}) for r in rows] == [[0], [1]]


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_nodes=0), ["num_nodes", ">= 1", "0"]),
    (dict(num_nodes=2, node_rank=2, port=29411), ["node_rank", "[0, 1]", "2"]),
    (dict(num_nodes=2, node_rank=-1, port=29411), ["node_rank"]),
    (dict(num_nodes=2, node_rank=1), ["port is required"]),
    (dict(num_nodes=2, node_rank=1, port=29411, rdzv_backend="etcd"), ["rdzv_backend", "'c10d'"]),
])
def test_bad_node_layout_is_refused_before_anything_starts(kwargs, words):
    before = {r["id"] for r in Registry().list_runs()}
    with pytest.raises(ValueError) as info:
        gpu_lab.launch(export_fns.train_tiny, num_processes=1, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert {r["id"] for r in Registry().list_runs()} == before, "a run was registered anyway"
