"""One record for a multi-node run: two launches with num_nodes=2, each in a process of its own
with its own GPU_LAB_HOME (as two machines would have), give one run in node 0's registry with
both ranks' events; node 1's registry keeps a row that points at it. Where network namespaces
can be made (root), node 1 runs in its own, behind a veth pair, so that the rendezvous, the
channel and its keys cross a real interface."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_lab.launch import free_port
from gpu_lab.record.registry import Registry

from job_utils import job_env

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

STEPS = 5
NODE = """
import json, sys
import gpu_lab, export_fns
k, addr, port, backend = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg = gpu_lab.TrainConfig(max_steps={steps})
run = gpu_lab.launch(export_fns.train_tiny, cfg, config=cfg, num_processes=1, num_nodes=2,
                     node_rank=k, master_addr=addr, port=port, rdzv_backend=backend,
                     name=f"node{{k}}")
status = run.wait(400)
print("RESULT " + json.dumps({{"id": run.id, "status": status}}), flush=True)
""".format(steps=STEPS)


def _start(k: int, home: Path, addr: str, port: int, prefix: list, iface: str | None,
           backend: str):
    env = job_env(home)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                         env["PYTHONPATH"]])
    if iface:  # gloo's own choice of interface (by host name) would be loopback here
        env["GLOO_SOCKET_IFNAME"] = iface
    return subprocess.Popen(prefix + [sys.executable, "-c", NODE, str(k), addr, str(port), backend],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _two_nodes(tmp_path: Path, addr: str, prefix: list, ifaces: tuple,
               backend: str = "c10d") -> tuple[dict, dict]:
    port = free_port()
    # node 1 first: it must wait for node 0's store, not fail for want of it
    nodes = [_start(k, tmp_path / f"home{k}", addr, port, prefix if k else [], ifaces[k],
                    backend)
             for k in (1, 0)][::-1]
    try:
        out = [p.communicate(timeout=500)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    said = []
    for p, text in zip(nodes, out):
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, text[-3000:]
        said.append(json.loads(lines[-1][len("RESULT "):]))
    logs = "\n".join(t[-1500:] for t in out)
    assert [s["status"] for s in said] == ["succeeded", "succeeded"], logs
    return said[0], said[1]


def _one_record(tmp_path: Path, node0: dict, node1: dict) -> None:
    reg0 = Registry(tmp_path / "home0" / "registry.db")
    reg1 = Registry(tmp_path / "home1" / "registry.db")
    assert [r["id"] for r in reg0.list_runs()] == [node0["id"]], "node 0 has more than its run"
    losses = reg0.metrics(node0["id"], "loss")
    per_rank = {r: sum(m["rank"] == r for m in losses) for r in (0, 1)}
    assert per_rank == {0: STEPS, 1: STEPS}, per_rank  # every report of both ranks, once
    assert reg0.count_events(node0["id"], "dropped") == 0, reg0.events(node0["id"])
    notes = [e["data"].get("text", "") for e in reg0.events(node0["id"]) if e["kind"] == "log"]
    assert any("a node joined the run" in t and node1["id"] in t for t in notes), notes
    row1 = reg1.get_run(node1["id"])
    assert row1["part_of"]["run"] == node0["id"] and row1["part_of"]["node_rank"] == 1, row1
    assert row1["status"] == "succeeded"
    assert reg1.metrics(node1["id"], "loss") == [], "node 1's ranks recorded in node 1's registry"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_nodes_two_homes_one_record_on_loopback(tmp_path, backend):
    node0, node1 = _two_nodes(tmp_path, "127.0.0.1", [], (None, None), backend)
    _one_record(tmp_path, node0, node1)


@pytest.mark.timeout(900)
def test_node_one_in_its_own_network_namespace_reports_to_node_zero(tmp_path, namespace):
    prefix, addr, host_if, ns_if = namespace
    node0, node1 = _two_nodes(tmp_path, addr, prefix, (host_if, ns_if))
    _one_record(tmp_path, node0, node1)
    row0 = Registry(tmp_path / "home0" / "registry.db").get_run(node0["id"])
    assert row0["events_address"].startswith(f"tcp://{addr}:"), row0["events_address"]


def test_the_recorder_admits_another_nodes_public_key_only(tmp_path):
    """Node 0's recorder takes events from a client pair made elsewhere once its public half is
    admitted; a pair that was not admitted is refused and counted, its events never read."""
    import time

    import zmq

    from gpu_lab.record.channel import ClientKey
    from gpu_lab.record.recorder import Recorder
    from gpu_lab.record.reporter import Reporter

    reg = Registry(tmp_path / "registry.db")
    reg.create_run("r1", name="r1")
    rec = Recorder(reg, "r1")
    pairs = [tuple(k.decode() for k in zmq.curve_keypair()) for _ in range(2)]
    admitted, stranger = (ClientKey(rec.keys.public, pub, sec) for pub, sec in pairs)
    rec.admit(admitted.public)
    with pytest.raises(ValueError, match="admitted public"):
        rec.admit("not a key")
    reps = [Reporter(rec.address, "r1", rank=r, key=k) for r, k in ((1, admitted), (2, stranger))]
    try:
        for rep in reps:
            for step in range(3):
                rep.report(step, loss=1.0)
            rep.flush()
        deadline = time.monotonic() + 60
        while (len(reg.metrics("r1", "loss")) < 3 or rec.refused < 1) \
                and time.monotonic() < deadline:
            rec.flush(1.0)
    finally:
        for rep in reps:
            rep.close()
        rec.close()
    assert sorted((m["rank"], m["step"]) for m in reg.metrics("r1", "loss")) == \
        [(1, 0), (1, 1), (1, 2)]
    assert rec.refused >= 1
