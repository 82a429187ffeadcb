"""gpu_lab.submit on a real Slurm cluster: a private one-node cluster (slurmctld, slurmd, munged in
a temp dir; gpu_lab.cluster.sandbox) takes real jobs whose ranks srun starts. A kernel submits a
2-rank job that waits behind a job holding every CPU (queued, with Slurm's reason), then runs and
succeeds with every report in the record; a second job is stopped from its Run, checkpoints, and
ends stopped while Slurm says CANCELLED. Then what only Slurm knows: a job cancelled while
pending, the checkpoint signal without a stop (requeued, resumed), and bad input refused before
sbatch runs."""
from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from gpu_lab.cluster import sandbox, slurm, states
from gpu_lab.record.registry import Registry

from proc_utils import wait_until

pytestmark = pytest.mark.slurm  # a private Slurm cluster

TESTS = Path(__file__).parent
STEPS = 12

@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The private cluster (4 CPUs, on this 2-core machine) and a GPU_LAB_HOME of the test's own;
    the job finds tests/ (cluster functions) on PYTHONPATH, as a user's module on a login node."""
    if not sandbox.installed():
        pytest.skip("Slurm is not installed (`make test` installs Debian's slurmctld, slurmd, "
                    "slurm-client and munge)")
    home = tmp_path / "home"
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    monkeypatch.setenv("GPU_LAB_SLURM_POLL_S", "0.5")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    with sandbox.private_cluster(tmp_path / "slurm", cpus=4) as env:
        yield {"env": env, "home": home, "tmp": tmp_path}
        _settle(home)


def _settle(home: Path) -> None:
    """No job, no follower left: every job cancelled, its end recorded, the follower gone."""
    from gpu_lab.cluster import follow

    subprocess.run(["scancel", f"--user={getpass.getuser()}"], check=True)
    reg = Registry()
    wait_until(lambda: not follow.Follower(reg).active(), 60, what="every job's end recorded")
    wait_until(lambda: not follow.following(home), 30, what="the follower to exit")


def _blocker(tmp: Path) -> tuple[str, Path]:
    """A job that holds every CPU of the node until `gate` exists."""
    gate = tmp / "gate"
    job = slurm.sbatch(str(_script(tmp / "blocker.sh", f"#SBATCH --ntasks=4\n"
                                   f"while [ ! -e {gate} ]; do sleep 0.2; done\n")))
    return job, gate


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/bash\n#SBATCH --output={path.parent}/%x-%j.out\n{body}")
    return path


CELLS = [
    f"""
import json, sys, time
sys.path.insert(0, {str(TESTS)!r})
import gpu_lab
from proc_utils import wait_until
cfg = gpu_lab.TrainConfig(max_steps={STEPS}, num_workers=0, output_dir={{out!r}})
""",
    # queued behind the blocker, with Slurm's reason; the kernel stays free
    """
t0 = time.monotonic()
run = gpu_lab.submit("export_fns:train_tiny", cfg, ranks_per_node=2, device="cpu", name="two-ranks")
submit_s = time.monotonic() - t0
wait_until(lambda: run.reason and "Resources" in run.reason, 60, what="Slurm's reason")
print(json.dumps({"status": run.status, "reason": run.reason, "job": run.job_id,
                  "submit_s": submit_s}))
""",
    """
open({gate!r}, "w").close()  # the blocker ends: the job starts
print(json.dumps({"status": run.wait(240), "result": run.result(), "reason": run.reason}))
""",
    # a job to stop: train_classifier checkpoints on the stop signal
    """
long = cfg.replace(model="tiny_cnn", image_size=16, batch_size=16, max_steps=100000,
                   num_workers=0, tensorboard=False, eval_every=0)
run2 = gpu_lab.submit(gpu_lab.train_classifier, long, ranks_per_node=2, device="cpu", name="to-stop")
assert run2.wait_for_step(3, rank=1, metric="loss", timeout=240), run2.status
print(json.dumps({"status": run2.stop(), "reason": run2.reason, "id": run2.id}))
""",
]


def test_a_kernel_submits_follows_and_stops_slurm_jobs(cluster):
    blocker, gate = _blocker(cluster["tmp"])
    out = str(cluster["tmp"] / "out")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{out!r}", repr(out)).replace(
        "{gate!r}", repr(str(gate)))) for c in CELLS]
    NotebookClient(nb, timeout=400, kernel_name="python3",
                   resources={"metadata": {"path": str(TESTS)}}).execute()
    said = [json.loads(_stdout(c).strip().splitlines()[-1]) for c in nb.cells[1:]]

    queued, done, stopped = said
    assert queued["status"] == "queued" and "Resources" in queued["reason"], queued
    assert queued["submit_s"] < 10, queued
    assert done["status"] == "succeeded" and done["reason"] is None, done
    assert done["result"]["world_size"] == 2, done
    from gpu_lab.cluster import follow  # its recorders count what never arrived as they retire
    wait_until(lambda: not follow.following(cluster["home"]), 60, what="the follower to end")
    reg = Registry()
    row = next(r for r in reg.list_runs() if r["name"] == "two-ranks")
    assert row["kind"] == "slurm" and row["job"]["id"] == queued["job"], row
    for rank in (0, 1):  # every report in the record
        assert [m["step"] for m in reg.metrics(row["id"], "loss", rank=rank)] == list(range(STEPS))
    assert not [e for e in reg.events(row["id"], kinds=["dropped"])]
    assert slurm.states([queued["job"]])[queued["job"]].state == "COMPLETED"

    assert stopped["status"] == "stopped" and stopped["reason"] == "stopped by the user", stopped
    row2 = reg.get_run(stopped["id"])
    ckpts = sorted((Path(row2["output_dir"]) / "checkpoints").glob("step_*"))
    assert ckpts and (ckpts[-1] / "manifest.json").is_file(), ckpts  # complete, not half-written
    # its status and Slurm's agree (the job cancels itself once its end is recorded)
    job = wait_until(lambda: (s := slurm.states([row2["job"]["id"]]).get(row2["job"]["id"]))
                     and s.state in states.FINAL and s, 60, what="Slurm's end of the stopped job")
    assert job.state == "CANCELLED"
    assert states.status_of(job.state, stop_reason="stopped by the user")[0] == row2["status"]
    for log in Path(row2["run_dir"], "logs").iterdir():  # private, though Slurm wrote them
        assert log.stat().st_mode & 0o077 == 0, log


def test_a_job_on_another_host_reports_to_the_lab_over_the_channel(tmp_path, monkeypatch,
                                                                    namespace):
    """The node (slurmd, and so the job) in a network namespace of its own: the ranks and the
    job's supervisor reach the run's recorder on this host across a real interface, with the
    run's keys; the registry never leaves this host."""
    import gpu_lab

    if not sandbox.installed():
        pytest.skip("Slurm is not installed")
    prefix, here, _, _ = namespace
    there = here.rsplit(".", 1)[0] + ".2"
    home = tmp_path / "home"
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    monkeypatch.setenv("GPU_LAB_SLURM_POLL_S", "0.5")
    monkeypatch.setenv("GPU_LAB_RECORDER_HOST", here)  # where the node reaches this host
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    # nsenter, not `ip netns exec`: that remounts /sys, where slurmd looks for cgroups
    enter = ("nsenter", f"--net=/run/netns/{prefix[-1]}")
    with sandbox.PrivateSlurm(tmp_path / "slurm", cpus=4, controller_addr=here, node_addr=there,
                              node_prefix=enter):
        run = gpu_lab.submit("export_fns:train_where",
                             gpu_lab.TrainConfig(max_steps=STEPS, num_workers=0),
                             ranks_per_node=2, device="cpu")
        assert run.wait(300) == "succeeded", (run.status, run.reason, run.logs(None, 30))
        where = run.result()
        reg = Registry()
        assert where["world_size"] == 2 and where["netns"] != os.readlink("/proc/self/ns/net")
        assert run._registry.get_run(run.id)["events_address"].startswith(f"tcp://{here}:")
        for rank in (0, 1):
            assert [m["step"] for m in reg.metrics(run.id, "loss", rank=rank)] == list(range(STEPS))
        _settle(home)


def test_a_short_job_submitted_while_the_follower_waits_loses_no_report(cluster, monkeypatch):
    """The follower serves a new job's recorder at its next look, which can come after a short
    job's ranks have reported and exited (a user's poll of 30 s): submit wakes it, and the job
    starts its ranks once its recorder took the connection. Every report is in the record."""
    import gpu_lab

    monkeypatch.setenv("GPU_LAB_SLURM_POLL_S", "30")
    out = str(cluster["tmp"] / "out")
    long = gpu_lab.submit(gpu_lab.train_classifier, gpu_lab.TrainConfig(
        model="tiny_cnn", image_size=16, batch_size=16, max_steps=100000, num_workers=0,
        tensorboard=False, eval_every=0, output_dir=out), device="cpu", name="keeps-it-busy")
    assert long.wait_for_step(1, metric="loss", timeout=240), long.status
    short = gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(
        max_steps=STEPS, num_workers=0, output_dir=out), ranks_per_node=2, device="cpu")
    assert short.wait(240) == "succeeded", (short.status, short.reason, short.logs(None, 30))
    reg = Registry()
    for rank in (0, 1):
        assert [m["step"] for m in reg.metrics(short.id, "loss", rank=rank)] == list(range(STEPS))
    assert not reg.events(short.id, kinds=["dropped"])
    assert long.stop() == "stopped"


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_a_script_is_submitted_unchanged_and_its_arguments_stay_private(cluster):
    """A user's accelerate script (never importing gpu_lab) as a 2-rank job: followed like a
    launched run; its arguments reach it but are on no command line Slurm shows."""
    import gpu_lab

    out, secret = cluster["tmp"] / "out", "s3cret-tag-value"
    run = gpu_lab.submit(str(TESTS / "own_code" / "train_accel.py"), "--lr", "0.05", "--steps",
                         "30", "--pace", "0.05", "--out", str(out), "--tag", secret,
                         ranks_per_node=2, device="cpu")
    assert run.wait_for_step(2, rank=0, timeout=240), (run.status, run.logs(None, 30))
    shown = subprocess.run(["scontrol", "show", "job", str(run.job_id)], capture_output=True,
                           text=True).stdout
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "gpu_lab.rank.headless" in ps and secret not in ps and secret not in shown
    assert secret not in Path(run.run_dir, "job", "job.sbatch").read_text()
    assert run.wait(240) == "succeeded", (run.status, run.reason, run.logs(0, 30))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["num_processes"], r["process_index"], r["distributed_type"]) for r in ranks] == \
        [(2, 0, "MULTI_CPU"), (2, 1, "MULTI_CPU")]
    assert ranks[0]["argv"][-2:] == ["--tag", secret]
    reg = Registry()
    assert [m["step"] for m in reg.metrics(run.id, "loss", rank=0)] == list(range(30))
    row = reg.get_run(run.id)
    assert row["name"] == "train_accel.py" and row["config"]["tag"] == secret


def test_a_job_cancelled_while_pending_is_recorded_by_the_follower(cluster):
    """Nothing of the job ran to say how it ended: Slurm's CANCELLED becomes stopped."""
    import gpu_lab

    blocker, gate = _blocker(cluster["tmp"])
    run = gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(max_steps=2, num_workers=0),
                         ranks_per_node=1, device="cpu")
    wait_until(lambda: run.reason and "Resources" in run.reason, 60, what="Slurm's reason")
    slurm.cancel(run.job_id)  # by hand, not through the Run
    assert run.wait(60) == "stopped"
    assert run.reason == "cancelled in Slurm (scancel, or an administrator)"
    assert Registry().get_run(run.id)["job"]["state"] == "CANCELLED"
    # the side panel's Stop (the server calls stop_run) withdraws a pending job the same way
    from gpu_lab.launch import stop_run

    other = gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(max_steps=2, num_workers=0),
                           ranks_per_node=1, device="cpu")
    wait_until(lambda: other.reason and "Resources" in other.reason, 60, what="Slurm's reason")
    assert stop_run(other.id) == "stopped"
    assert other.wait(60) == "stopped" and "withdrawn from Slurm's queue" in other.reason
    job = wait_until(lambda: (s := other.slurm_state()) and s.state in states.FINAL and s, 60,
                     what="Slurm's end of the withdrawn job")
    assert job.state == "CANCELLED"
    gate.touch()


def test_the_checkpoint_signal_without_a_stop_requeues_and_resumes(cluster):
    """What Slurm's time limit does (SIGUSR1 before it, here sent at once): the ranks checkpoint,
    the job requeues itself, starts again, resumes from the checkpoint and finishes, one run."""
    import gpu_lab

    cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=20,
                              num_workers=0, tensorboard=False, eval_every=0,
                              output_dir=str(cluster["tmp"] / "out"))
    run = gpu_lab.submit(gpu_lab.train_classifier, cfg, ranks_per_node=2, device="cpu")
    assert run.wait_for_step(3, rank=0, metric="loss", timeout=240)
    slurm.signal(run.job_id, "USR1")
    # Slurm holds a requeued job as long as a job credential lasts (the private cluster's: 10 s)
    assert run.wait(300) == "succeeded", (run.status, run.logs(None, 30))
    reg = Registry()
    row = reg.get_run(run.id)
    assert row["job"]["attempt"] == 1, row["job"]  # the second attempt finished it
    said = [e["data"] for e in reg.events(run.id, kinds=["status"])]
    assert any(d["status"] == "queued" and "requeued" in (d.get("reason") or "") for d in said)
    assert "resuming from step" in run.logs(0, None)
    assert max(m["step"] for m in reg.metrics(run.id, "loss", rank=0)) == cfg.max_steps


def test_a_follower_killed_mid_job_is_replaced_and_nothing_is_lost_uncounted(cluster):
    """The follower hosts the job's recorder: SIGKILLed while the ranks report, the next
    ClusterRun that follows the job starts another, which listens on the same port with the same
    keys; the ranks' sockets reconnect and their reports land. What was on the way to the killed
    recorder (a batch in its socket, or received and not yet written) is counted, by rank."""
    import signal

    import gpu_lab
    from gpu_lab.cluster import follow

    steps = 40
    run = gpu_lab.submit("export_fns:train_tiny",
                         gpu_lab.TrainConfig(max_steps=steps, num_workers=0, lr=0.01),
                         ranks_per_node=2, device="cpu", env={"TINY_STEP_SLEEP": "0.1"})
    assert run.wait_for_step(5, rank=1, timeout=240)
    pid = json.loads((cluster["home"] / follow.LOCK).read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not follow.following(cluster["home"]), 30, what="the follower to die")
    again = gpu_lab.attach(run.id)  # a ClusterRun: it starts the follower again
    assert again.wait(300) == "succeeded", (again.status, again.reason)
    # the count is made when the recorder retires, once stragglers had their chance; the
    # follower ends after that
    wait_until(lambda: not follow.following(cluster["home"]), 60, what="the follower to end")
    reg = Registry()
    notes = reg.events(run.id, kinds=["dropped"])
    counted = {int(r): n for e in notes for r, n in e["data"].get("ranks", {}).items()}
    for rank in (0, 1):
        got = [m["step"] for m in reg.metrics(run.id, "loss", rank=rank)]
        assert got == sorted(set(got)) and set(got) <= set(range(steps))
        assert got[-1] == steps - 1  # the reports after the restart all landed
        # one report per step, each its own event: a missing step is a missing event
        assert steps - len(got) <= counted.get(rank, 0), (rank, got, notes)
    assert sum(counted.values()) == sum(e["data"]["count"] for e in notes)


def test_bad_input_is_refused_before_anything_is_made(gpu_lab_home, monkeypatch):
    import gpu_lab
    from gpu_lab.rank.address import EntryError

    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    with pytest.raises(EntryError, match="has no attribute 'train_tinny'"):
        gpu_lab.submit("export_fns:train_tinny", gpu_lab.TrainConfig(), device="cpu")
    with pytest.raises(ValueError, match="JobSpec.num_nodes: got 0"):
        gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(), nodes=0, device="cpu")
    with pytest.raises(ValueError, match="JobSpec.time_limit: got 'soon'"):
        gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(), time_limit="soon",
                       device="cpu")
    with pytest.raises(ValueError, match="JobSpec.device: got 'tpu'"):
        gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(), device="tpu")
    with monkeypatch.context() as m:
        m.setenv("PATH", str(Path(sys.executable).parent))  # no Slurm commands
        with pytest.raises(slurm.SlurmError, match="sbatch.*not on the PATH"):
            gpu_lab.submit("export_fns:train_tiny", gpu_lab.TrainConfig(), device="cpu")
    assert not (gpu_lab_home / "runs").exists()  # nothing was made


@pytest.mark.parametrize("state, status", [
    ("PENDING", "queued"), ("REQUEUED", "queued"), ("RUNNING", "running"),
    ("COMPLETING", "running"), ("COMPLETED", "succeeded"), ("FAILED", "failed"),
    ("NODE_FAIL", "failed"), ("OUT_OF_MEMORY", "failed"), ("CANCELLED", "stopped"),
    ("TIMEOUT", "stopped"), ("PREEMPTED", "stopped"), ("CANCELLED+", "stopped"),
    ("A_STATE_SLURM_ADDS_LATER", "running")])
def test_the_state_table(state, status):
    assert states.status_of(state, "Resources")[0] == status


def test_pending_reasons_read_as_advice():
    assert states.status_of("PENDING", "Resources") == (
        "queued", "waiting in Slurm's queue: Resources (the nodes it asks for are busy)")
    assert "shorter time_limit" in states.status_of("PENDING", "PartitionTimeLimit")[1]
    assert states.status_of("PENDING", "SomethingNew")[1] == "waiting in Slurm's queue: SomethingNew"
    assert "sbatch --mem" in states.status_of("OUT_OF_MEMORY")[1]
    assert states.status_of("CANCELLED", stop_reason="pruned by a sweep") == (
        "stopped", "pruned by a sweep")


def test_reports_that_never_reached_the_record_are_counted_by_rank(gpu_lab_home, tmp_path):
    """A job's ranks leave how many events they sent; the events the record lacks when the
    run's recorder retires (a follower killed while they were on the way) are one `dropped` note,
    by rank. A job whose every event arrived gets none."""
    from gpu_lab.cluster.relay import Relay
    from gpu_lab.record import events as ev
    from gpu_lab.record.recorder import Recorder
    from gpu_lab.record.runfolder import RunFolder

    reg = Registry()
    relay = Relay(reg)
    for rid, sent in (("whole", {0: 3, 1: 3}), ("short", {0: 3, 1: 5})):
        folder = RunFolder(tmp_path / rid).create()
        reg.create_run(rid, run_dir=str(folder.path), kind="slurm", status="running")
        for rank, n in sent.items():
            folder.write_sent(rank, n)
        relay.recorders[rid] = rec = Recorder(reg, rid)
        rec.record([ev.make(rid, r, ev.METRIC, {"loss": 1.0}, step=s)
                    for r in (0, 1) for s in range(3)])
        reg.set_status(rid, "succeeded")
    relay.retire(set())
    relay.retire(set())  # QUIET_LOOKS later: counted, then closed
    assert not relay.recorders
    assert not reg.events("whole", kinds=["dropped"])
    (note,) = reg.events("short", kinds=["dropped"])
    assert note["rank"] == -1 and note["data"]["count"] == 2 and note["data"]["ranks"] == {"1": 2}
    assert "never reached the record" in note["data"]["text"]


def test_a_jobs_end_waits_for_its_ranks_last_reports(gpu_lab_home, tmp_path, monkeypatch):
    """The job's supervisor says its end on its own socket, which can overtake the ranks' last
    reports: the row and a Run handle end only once the record holds what the ranks say they
    sent, so that what wait() returns to reads the whole run. A shortfall that never arrives
    ends it after END_WAIT_S, counted."""
    from gpu_lab.cluster import relay as relay_mod
    from gpu_lab.launch.run import attach_run
    from gpu_lab.record import events as ev
    from gpu_lab.record.recorder import Recorder
    from gpu_lab.record.runfolder import RunFolder

    def loss(rid, steps):
        return [ev.make(rid, 0, ev.METRIC, {"loss": 1.0 / (s + 1)}, step=s) for s in steps]

    def job_says(rid):
        return [ev.make(rid, -1, ev.STATUS, {"status": "succeeded", "exitcode": 0,
                                             "from": ev.FROM_JOB})]

    reg = Registry()
    relay = relay_mod.Relay(reg)
    try:
        for rid in ("late", "short"):
            folder = RunFolder(tmp_path / rid).create()
            reg.create_run(rid, run_dir=str(folder.path), kind="slurm", status="running")
            folder.write_sent(0, 4)
            relay.recorders[rid] = Recorder(reg, rid)
        rec = relay.recorders["late"]
        rec.record(loss("late", [0, 1]))
        run = attach_run("late", reg)
        rec.record(job_says("late"))
        rec.flush()
        said = reg.events("late", kinds=[ev.STATUS])[-1]["seq"]
        wait_until(lambda: run._seq >= said, 30, what="the handle reading the job's word")
        assert relay.apply(reg.get_run("late"))["status"] == "running"
        assert run.status == "running" and not run.done
        rec.record(loss("late", [2, 3]))  # the stragglers
        rec.flush()
        assert relay.apply(reg.get_run("late"))["status"] == "succeeded"
        assert run.wait(30) == "succeeded"
        assert run.metrics.series("loss", 0)[0] == [0, 1, 2, 3]
        end = reg.events("late", kinds=[ev.STATUS])[-1]
        assert end["data"]["from"] == relay_mod.FROM_RECORD and end["seq"] > said

        monkeypatch.setattr(relay_mod, "END_WAIT_S", 0.0)  # two of four never come
        rec = relay.recorders["short"]
        rec.record(loss("short", [0, 1]) + job_says("short"))
        rec.flush()
        assert relay.apply(reg.get_run("short"))["status"] == "succeeded"
        relay.retire(set())
        relay.retire(set())
        (note,) = reg.events("short", kinds=["dropped"])
        assert note["data"]["ranks"] == {"0": 2}
    finally:
        relay.close()
