"""A run across two nodes: a private two-node Slurm cluster whose nodes are hosts of their own
(gpu_lab.cluster.sandbox.Hosts: network, host-name and mount namespaces on a bridge; slurmd on
each), started once for this file. From a real kernel: a 2-node job queued with Slurm's reason,
then running with a rank on each host, every report of both ranks in one record on this host,
stopped (CANCELLED, a checkpoint, nothing left on either node). A node killed mid-job: the run
fails naming it, and resumes from its checkpoint once the node is back; a job that may be
requeued goes back in the queue and resumes by itself. A launched 2-node run
(node 0 here, node 1 on a private host, no Slurm): a stop from either node's launch ends both
nodes `stopped`. In the browser: the job's line and both nodes' curves in the run view."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpu_lab.cluster import sandbox, slurm, states
from gpu_lab.record.registry import Registry

from lab_utils import jupyter_lab
from proc_utils import wait_until
from test_browser import (_page, _series_points, _shot, browser,  # noqa: F401
                          open_run_view, page_errors)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

TESTS = Path(__file__).parent
JOB_PROCESSES = ("python", "slurmstepd", "srun", "bash")  # what a job leaves if it leaks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts and a Slurm cluster with a node on each (2 CPUs declared per node); this
    host is the login node: the controller, the registry and the runs' recorders live here."""
    if not sandbox.installed():
        pytest.skip("Slurm is not installed (`make test` installs Debian's slurmctld, slurmd, "
                    "slurm-client and munge)")
    why = sandbox.Hosts.available()
    if why:
        pytest.skip(f"a two-node cluster needs private hosts: {why}")
    tmp = tmp_path_factory.mktemp("two-nodes")
    home = tmp / "home"
    with pytest.MonkeyPatch.context() as mp, sandbox.Hosts(tmp / "hosts", 2) as hosts:
        mp.setenv("GPU_LAB_HOME", str(home))
        mp.setenv("GPU_LAB_SLURM_POLL_S", "0.5")
        mp.setenv("GPU_LAB_RECORDER_HOST", hosts.bridge_addr)  # where the nodes reach this host
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS),
                                                              os.environ.get("PYTHONPATH")])))
        slurmd = sandbox.PrivateSlurm(tmp / "slurm", cpus=2, hosts=hosts, slurmd_timeout=5)
        with slurmd:
            yield {"hosts": hosts, "slurm": slurmd, "home": home, "tmp": tmp,
                   "nodes": slurmd.node_names}
            _settle(home)


def _settle(home: Path) -> None:
    from gpu_lab.cluster import follow

    subprocess.run(["scancel", f"--user={psutil.Process().username()}"], check=True)
    wait_until(lambda: not follow.Follower(Registry()).active(), 60, what="every job's end")


def _left_on(hosts: sandbox.Hosts, node: str) -> list[str]:
    """What still runs on `node` besides its slurmd."""
    left = []
    for pid in hosts.pids(node):
        try:
            name = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            continue
        if name != "slurmd":
            left.append(f"{pid} {name}")
    return left


def _blocker(tmp: Path) -> Path:
    """A job that holds every CPU of both nodes until `gate` exists."""
    gate = tmp / "gate"
    script = tmp / "blocker.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                      f"#SBATCH --output={tmp}/blocker-%j.out\n"
                      f"while [ ! -e {gate} ]; do sleep 0.2; done\n")
    slurm.sbatch(str(script))
    return gate


def _long(out: Path) -> dict:
    """A run to stop or kill: tiny, long, a checkpoint every 5 steps."""
    return dict(model="tiny_cnn", image_size=16, batch_size=16, max_steps=100000, num_workers=0,
                tensorboard=False, eval_every=0, checkpoint_every=5, output_dir=str(out))


def test_a_kernel_submits_a_two_node_job_follows_it_and_stops_it(cluster, kernels):
    hosts, nodes = cluster["hosts"], cluster["nodes"]
    gate = _blocker(cluster["tmp"])
    k = kernels("import gpu_lab, time\nfrom proc_utils import wait_until")
    queued = k.json(f"""
run = gpu_lab.submit(gpu_lab.train_classifier, gpu_lab.TrainConfig(**{_long(cluster['tmp'] / 'out')!r}),
                     nodes=2, ranks_per_node=1, device="cpu", name="two-nodes")
wait_until(lambda: run.reason and "Resources" in run.reason, 60, what="Slurm's reason")
print(json.dumps({{"id": run.id, "status": run.status, "reason": run.reason, "job": run.job_id}}))
""")
    assert queued["status"] == "queued", queued
    assert "waiting in Slurm's queue: Resources" in queued["reason"], queued
    gate.touch()  # the blocker ends: the job starts on both nodes
    running = k.json("""
assert run.wait_for_step(12, rank=1, metric="loss", timeout=240), (run.status, run.reason)
print(json.dumps({"status": run.status, "job": run.job}))
""", timeout=300)
    assert running["status"] == "running", running
    assert running["job"]["nodes"] == f"{nodes[0].rsplit('-', 1)[0]}-n[0-1]", running["job"]
    reg = Registry()
    # each rank says where it runs: one rank on each host, one process group (world size 2)
    said = {e["rank"]: e["data"]["host"] for e in reg.events(queued["id"], kinds=["status"])
            if e["rank"] >= 0 and e["data"].get("host")}
    assert said == {0: nodes[0], 1: nodes[1]}, said
    stopped = k.json("""
print(json.dumps({"status": run.stop(), "reason": run.reason}))
""")
    assert stopped == {"status": "stopped", "reason": "stopped by the user"}, stopped
    job = wait_until(lambda: (s := slurm.states([queued["job"]]).get(queued["job"]))
                     and s.state in states.FINAL and s, 60, what="Slurm's end of the job")
    assert job.state == "CANCELLED", job
    row = reg.get_run(queued["id"])
    ckpts = sorted((Path(row["output_dir"]) / "checkpoints").glob("step_*"))
    assert ckpts and (ckpts[-1] / "manifest.json").is_file(), ckpts
    # every report of both ranks, in one record: each rank's steps from 1 (fit counts optimizer
    # steps done) to its last, no gap
    for rank in (0, 1):
        steps = [m["step"] for m in reg.metrics(queued["id"], "loss", rank=rank)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 12, (rank, steps[:5])
    assert not reg.events(queued["id"], kinds=["dropped"])
    for node in nodes:
        wait_until(lambda: not _left_on(hosts, node), 30, what=f"nothing left on {node}")


def test_a_node_killed_mid_job_fails_naming_it_and_the_run_resumes(cluster):
    import gpu_lab
    from gpu_lab.failures.kinds import NODE

    hosts, nodes, cl = cluster["hosts"], cluster["nodes"], cluster["slurm"]
    cfg = gpu_lab.TrainConfig(**_long(cluster["tmp"] / "out"))
    run = gpu_lab.submit(gpu_lab.train_classifier, cfg, nodes=2, ranks_per_node=1, device="cpu",
                         requeue=False, name="loses-a-node")
    assert run.wait_for_step(12, rank=1, metric="loss", timeout=240), (run.status, run.reason)
    assert cl.kill_node(nodes[1]) >= 2  # its slurmd, its job step, its rank
    try:
        assert run.wait(120) == "failed", (run.status, run.reason)
        # Slurm's verdict, or the job's own knock on the node's slurmd, whichever came first
        assert f"lost node {nodes[1]} (" in (run.reason or ""), (run.reason, run.logs(None, 20))
        first = run.error.first  # the root cause: the node, not rank 0's lost connection
        assert (first.rank, first.category, first.details["node"]) == (1, NODE, nodes[1]), first
        job = wait_until(lambda: (j := run.slurm_state()) and j.state in states.FINAL and j, 60,
                         what="Slurm's end of the job")
        assert job.state in ("NODE_FAIL", "FAILED"), job  # which, depends on who was first
        for node in nodes:  # Slurm ended what ran on the node that is left
            wait_until(lambda: not _left_on(hosts, node), 30, what=f"nothing left on {node}")
    finally:
        cl.start_node(nodes[1])  # the node is back: slurmd registers, ReturnToService=2
    ckpt = max(int(p.name.split("_")[1]) for p in
               (Path(Registry().get_run(run.id)["output_dir"]) / "checkpoints").glob("step_*"))
    again = run.resume(max_steps=ckpt + 6)
    assert again.wait(240) == "succeeded", (again.status, again.reason, again.logs(None, 20))
    reg = Registry()
    steps = [m["step"] for m in reg.metrics(again.id, "loss", rank=1)]
    assert steps and steps[0] == ckpt + 1, steps  # the step after the checkpoint's
    assert f"resuming from step {ckpt}" in again.logs(0, None)


def test_losing_the_jobs_first_node_is_named_by_the_follower(cluster):
    """The node that runs the job's supervisor is the one lost: nothing of the job can say how it
    ended, so the follower reads Slurm's NODE_FAIL and names the node."""
    import gpu_lab
    from gpu_lab.failures.kinds import NODE

    hosts, nodes, cl = cluster["hosts"], cluster["nodes"], cluster["slurm"]
    run = gpu_lab.submit(gpu_lab.train_classifier,
                         gpu_lab.TrainConfig(**_long(cluster["tmp"] / "out")), nodes=2,
                         ranks_per_node=1, device="cpu", requeue=False, name="loses-node-0")
    assert run.wait_for_step(3, rank=0, metric="loss", timeout=240), (run.status, run.reason)
    cl.kill_node(nodes[0])
    try:
        assert run.wait(120) == "failed", (run.status, run.reason)
        assert run.reason.startswith(f"Slurm: NODE_FAIL: lost node {nodes[0]} ("), run.reason
        assert (run.error.first.rank, run.error.first.category) == (0, NODE), run.error
        for node in nodes:
            wait_until(lambda: not _left_on(hosts, node), 30, what=f"nothing left on {node}")
    finally:
        cl.start_node(nodes[0])


def test_a_requeueable_job_that_loses_a_node_goes_back_in_the_queue_and_resumes(cluster):
    """requeue=True (submit's default): Slurm requeues a job after a node failure, so the run
    is `queued`, naming the node, not failed; it starts again once the node is back and resumes
    from the checkpoint, one run."""
    import gpu_lab

    hosts, nodes, cl = cluster["hosts"], cluster["nodes"], cluster["slurm"]
    cfg = gpu_lab.TrainConfig(**dict(_long(cluster["tmp"] / "out"), max_steps=30))
    run = gpu_lab.submit(gpu_lab.train_classifier, cfg, nodes=2, ranks_per_node=1, device="cpu",
                         name="requeued")
    assert run.wait_for_step(12, rank=1, metric="loss", timeout=240), (run.status, run.reason)
    cl.kill_node(nodes[1])
    reg = Registry()
    try:
        said = wait_until(lambda: next((e["data"] for e in reg.events(run.id, kinds=["status"])
                                        if "lost node" in (e["data"].get("reason") or "")), None),
                          120, what="the job's word on the lost node")
        assert said["status"] == "queued" and f"lost node {nodes[1]} (" in said["reason"], said
        assert "Slurm requeues the job" in said["reason"], said
        assert run.status == "queued", (run.status, run.reason)
    finally:
        cl.start_node(nodes[1])
    assert run.wait(240) == "succeeded", (run.status, run.reason, run.logs(None, 20))
    assert reg.get_run(run.id)["job"]["attempt"] == 1
    log = run.logs(0, None)
    ckpt = int(log.split("resuming from step ")[1].split()[0])
    steps = [m["step"] for m in reg.metrics(run.id, "loss", rank=1)]
    assert ckpt >= 10 and steps[-1] == cfg.max_steps and ckpt + 1 in steps, (ckpt, steps)
    for node in nodes:
        wait_until(lambda: not _left_on(hosts, node), 30, what=f"nothing left on {node}")


NODE1 = """
import json, os, sys
import gpu_lab, export_fns
fn = {"fit": gpu_lab.train_classifier, "plain": export_fns.train_tiny}[sys.argv[3]]
cfg = gpu_lab.TrainConfig(**json.loads(sys.argv[4]))
run = gpu_lab.launch(fn, cfg, num_processes=1, num_nodes=2, node_rank=1,
                     master_addr=sys.argv[1], port=int(sys.argv[2]), name="node1")
if sys.argv[5] == "node 1":  # the stop comes from this node, once node 0 saw step 8
    from proc_utils import wait_until
    wait_until(lambda: os.path.exists(sys.argv[6]), 240, what="node 0's word")
    run.stop()
from gpu_lab.record.registry import Registry
print(json.dumps({"id": run.id, "status": run.wait(300), "reason": run.reason,
                  "part_of": Registry().get_run(run.id)["part_of"]}))
"""


@pytest.mark.parametrize("kind, stopper", [("fit", "node 0"), ("plain", "node 0"),
                                           ("plain", "node 1")])
def test_a_launched_two_node_run_is_stopped_from_either_node(cluster, kernels, kind, stopper):
    """Node 0 is this host (its kernel), node 1 a private host with its own GPU_LAB_HOME; "plain":
    a function without fit(), whose ranks die of the stop instead of checkpointing, so the other
    node's ranks only see their peers vanish."""
    from gpu_lab.launch import free_port

    hosts, nodes = cluster["hosts"], cluster["nodes"]
    tmp = cluster["tmp"] / f"{kind}-{stopper.replace(' ', '')}"
    tmp.mkdir(parents=True)
    port = free_port(hosts.bridge_addr)
    cfg = _long(tmp / "out")
    env = dict(os.environ, GPU_LAB_HOME=str(tmp / "node1-home"), TINY_STEP_SLEEP="0.05")
    node1 = subprocess.Popen([*hosts.prefix(nodes[1]), sys.executable, "-c", NODE1,
                              hosts.bridge_addr, str(port), kind, json.dumps(cfg), stopper,
                              str(tmp / "seen-step-8")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        k = kernels("import gpu_lab, export_fns, os\nos.environ['TINY_STEP_SLEEP'] = '0.05'")
        said = k.json(f"""
fn = {{"fit": gpu_lab.train_classifier, "plain": export_fns.train_tiny}}[{kind!r}]
run = gpu_lab.launch(fn, gpu_lab.TrainConfig(**{cfg!r}), num_processes=1, num_nodes=2,
                     node_rank=0, master_addr={hosts.bridge_addr!r}, port={port}, name="node0")
assert run.wait_for_step(8, rank=1, metric="loss", timeout=240), (run.status, run.logs(None, 20))
if {stopper!r} == "node 0":
    status = run.stop()
else:
    open({str(tmp / "seen-step-8")!r}, "w").close()
    status = run.wait(120)
print(json.dumps({{"id": run.id, "status": status, "reason": run.reason}}))
""", timeout=300)
        out = node1.communicate(timeout=120)[0]
    finally:
        if node1.poll() is None:
            node1.kill()
    assert said["status"] == "stopped" and said["reason"] == "stopped by the user", said
    other = json.loads(out.strip().splitlines()[-1])
    # node 1's row, kept on node 1, is part of node 0's run and ends the same way
    assert other["part_of"]["run"] == said["id"], other
    assert (other["status"], other["reason"]) == ("stopped", "stopped by the user"), out[-3000:]
    reg = Registry()
    assert {m["rank"] for m in reg.metrics(said["id"], "loss")} == {0, 1}
    if kind == "fit":  # both ranks agreed on the stop: one checkpoint, at the step they reached
        ckpts = sorted((tmp / "out").glob(f"{said['id']}/checkpoints/step_*"))
        assert ckpts and (ckpts[-1] / "manifest.json").is_file(), ckpts
    wait_until(lambda: not _left_on(cluster["hosts"], nodes[1]), 30,
               what=f"nothing left on {nodes[1]}")


@pytest.mark.browser
def test_the_run_view_shows_the_job_line_and_each_nodes_curves(cluster, browser,  # noqa: F811
                                                                tmp_path):
    import gpu_lab

    nodes = cluster["nodes"]
    run = gpu_lab.submit(gpu_lab.train_classifier,
                         gpu_lab.TrainConfig(**_long(cluster["tmp"] / "out")), nodes=2,
                         ranks_per_node=1, device="cpu", name="two-nodes-view")
    root = tmp_path / "root"
    root.mkdir()
    try:
        assert run.wait_for_step(1, rank=1, metric="loss", timeout=240), (run.status, run.reason)
        with jupyter_lab(tmp_path, root, env={"GPU_LAB_HOME": str(cluster["home"])},
                         name="browser-two-nodes") as lab, \
                _page(browser, {"width": 1400, "height": 900}, "two-nodes-") as (page, console):
            page.goto(f"{lab.url}lab?token={lab.token}")
            page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)
            view = open_run_view(page, run.id)
            # the job's line: Slurm's id, state and node list
            line = view.locator(".jp-GpuLab-rv-job")
            line.wait_for()
            assert line.inner_text() == f"Slurm job {run.job_id} (RUNNING) on {run.job['nodes']}"
            # each rank's curve names its node, beside their mean
            want = {f"rank 0 · {nodes[0]}", f"rank 1 · {nodes[1]}", "mean"}
            wait_until(lambda: all(_series_points(view, "loss").get(k, 0) >= 5 for k in want),
                       120, what="both nodes' loss curves", hint=lambda: _series_points(
                           view, "loss"))
            _shot(page, "two-nodes-run-view")
            assert not page_errors(console), console
    finally:
        assert run.stop() == "stopped", (run.status, run.reason)
