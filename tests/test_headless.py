"""`python -m gpu_lab.rank.headless`: headless runs record themselves in the registry; bad input is
refused before anything starts; failures, stops and Slurm preemption (requeue + resume) end up
as the right status.

Slurm itself cannot run here (no controller), so the exported sbatch script runs under bash with
test doubles for `srun` and `scontrol` (tests/slurm_doubles/): srun starts the tasks with
SLURM_PROCID etc. and returns the highest exit code, like srun; scontrol records the requeue.
The ranks, the training toolkit's PreemptionGuard, the signal and the exit codes are real.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.config import TrainConfig
from gpu_lab.export import export
from gpu_lab.record.registry import Registry
from gpu_lab.rank.headless import Topology, derive_run_id, detect_topology

from proc_utils import wait_until
from job_utils import TESTS, job_env

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

DOUBLES = TESTS / "slurm_doubles"


def headless(tmp_path: Path, *args: str, timeout: float = 120, **env_extra):
    env = job_env(tmp_path / "home")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "gpu_lab.rank.headless", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def write_config(tmp_path: Path, **fields) -> str:
    p = tmp_path / "config.json"
    p.write_text(TrainConfig(**fields).to_json())
    return str(p)


@pytest.mark.parametrize("args, words", [
    (["no_such_module_xyz:train"], ["no_such_module_xyz", "cannot be imported"]),
    (["export_fns:no_such_fn"], ["no attribute 'no_such_fn'", "train_tiny"]),
    (["export_fns.train_tiny"], ["expected 'package.module:function'"]),
    (["export_fns:train_tiny", "--config", "missing.json"], ["--config", "missing.json",
                                                             "not a file"]),
])
def test_bad_input_fails_before_anything_starts(tmp_path, args, words):
    out = headless(tmp_path, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)
    home = tmp_path / "home"
    assert not (home / "runs").exists(), "a run directory was made for a run that never started"
    assert not (home / "registry.db").exists() or Registry(home / "registry.db").list_runs() == []


def test_bad_config_field_is_named(tmp_path):
    (tmp_path / "bad.json").write_text('{"max_steps": 5, "learnig_rate": 0.1}')
    out = headless(tmp_path, "export_fns:train_tiny", "--config", "bad.json")
    assert out.returncode == 2
    assert "learnig_rate" in out.stderr and "learning_rate" in out.stderr


def test_alone_records_metrics_and_success(tmp_path):
    cfg = write_config(tmp_path, max_steps=3)
    out = headless(tmp_path, "export_fns:report_only", "--config", cfg, "--run-id", "solo-1",
                    "--name", "solo")
    assert out.returncode == 0, out.stderr[-3000:]
    reg = Registry(tmp_path / "home" / "registry.db")
    row = reg.get_run("solo-1")
    assert (row["status"], row["kind"], row["name"], row["num_processes"]) == \
        ("succeeded", "python", "solo", 1)
    assert [m["step"] for m in reg.metrics("solo-1", "loss")] == [0, 1, 2]
    with open(Path(row["run_dir"]) / "result.pkl", "rb") as f:
        assert pickle.load(f) == "done"


def test_exception_marks_the_run_failed_with_its_message(tmp_path):
    out = headless(tmp_path, "export_fns:raises", "--run-id", "boom")
    assert out.returncode == 1
    assert "ValueError: broke on purpose" in out.stderr
    reg = Registry(tmp_path / "home" / "registry.db")
    row = reg.get_run("boom")
    assert row["status"] == "failed" and "ValueError: broke on purpose" in row["error"]
    assert (Path(row["run_dir"]) / "errors" / "rank0.json").is_file()
    assert [m["value"] for m in reg.metrics("boom", "loss")] == [2.0]  # reported before the raise


def test_sigterm_without_a_guard_is_recorded_as_stopped(tmp_path):
    out = headless(tmp_path, "export_fns:sigterm_self", "--run-id", "term")
    assert out.returncode == 143, out.stderr[-2000:]
    row = Registry(tmp_path / "home" / "registry.db").get_run("term")
    assert row["status"] == "stopped"
    assert row["error"].startswith("rank 0: stopped by SIGTERM outside fit()'s preemption guard")


def test_slurm_warning_before_fit_starts_still_requeues(tmp_path):
    """SIGUSR1's default action kills a process: a time-limit warning that arrives while the ranks
    still start up must end them with 143 (requeue), not with 138 (lost)."""
    out = headless(tmp_path, "export_fns:sigusr1_self", "--run-id", "usr1")
    assert out.returncode == 143, out.stderr[-2000:]
    row = Registry(tmp_path / "home" / "registry.db").get_run("usr1")
    assert row["status"] == "stopped" and "SIGUSR1" in row["error"]


def test_a_closed_terminal_is_a_stop_too(tmp_path):
    """SIGHUP (a terminal closed, or torchrun's agent passing one on) is one of the stop signals:
    the rank ends 'stopped' with 143, like SIGTERM, instead of dying of it."""
    out = headless(tmp_path, "export_fns:sighup_self", "--run-id", "hup")
    assert out.returncode == 143, out.stderr[-2000:]
    row = Registry(tmp_path / "home" / "registry.db").get_run("hup")
    assert row["status"] == "stopped" and "SIGHUP" in row["error"]


def test_an_unpicklable_result_is_recorded_and_explained(tmp_path):
    """The same outcome as a notebook launch's: the run succeeded, result.pkl says why there is
    no value, the rank's log and the run's record say so, and Run.result() raises with it."""
    from gpu_lab.launch import RunFailedError
    from gpu_lab.record import events as ev

    out = headless(tmp_path, "export_fns:returns_unpicklable", "--run-id", "unp")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "could not be pickled" in out.stderr
    reg = Registry(tmp_path / "home" / "registry.db")
    assert reg.get_run("unp")["status"] == "succeeded"
    [note] = reg.last_events("unp", [ev.LOG], 10)
    assert "could not be pickled" in note["data"]["text"]
    with pytest.raises(RunFailedError, match=r"rank 0's return value could not be pickled: "
                                             r"function: .*lambda"):
        gpu_lab.attach("unp", registry=reg).result(timeout=5)


@pytest.mark.timeout(600)
def test_torchrun_rank_failure_fails_the_run_and_names_the_rank(tmp_path):
    job = export(TrainConfig(), "export_fns:rank1_fails_rank0_waits", "torchrun",
                 nproc_per_node=2, out_dir=tmp_path)
    out = subprocess.run(job.argv, cwd=tmp_path, env=job_env(tmp_path / "home"),
                         capture_output=True, text=True, timeout=500, start_new_session=True)
    assert out.returncode != 0
    [row] = Registry(tmp_path / "home" / "registry.db").list_runs()
    # torchrun then ends rank 0 with SIGTERM (a stop): that must not hide rank 1's failure
    assert row["status"] == "failed", row
    assert row["error"] == "rank 1: ValueError: rank one broke on purpose"
    assert {m["rank"] for m in Registry(tmp_path / "home" / "registry.db").metrics(
        row["id"], "loss")} == {0, 1}


@pytest.mark.parametrize("outcomes, status, error", [
    ([(0, "succeeded", None)], "succeeded", None),
    ([(1, "succeeded", None)], "running", None),  # only local rank 0 declares success
    ([(1, "failed", "rank 1: first"), (0, "failed", "rank 0: closed by peer")], "failed",
     "rank 1: first"),                            # the first failure is the root cause
    ([(1, "failed", "rank 1: boom"), (0, "stopped", "rank 0: stop")], "failed", "rank 1: boom"),
    ([(0, "succeeded", None), (1, "failed", "rank 1: late")], "failed", "rank 1: late"),
    ([(0, "stopped", "rank 0: preempted"), (0, "succeeded", None)], "stopped", "rank 0: preempted"),
])
def test_rank_outcomes_combine_into_one_status(tmp_path, outcomes, status, error):
    from gpu_lab.rank.headless import close_row

    reg = Registry(tmp_path / "r.db")
    reg.create_run("r", status="running")
    for local_rank, st, err in outcomes:
        topo = Topology("torchrun", local_rank, local_rank, 2, 2, 0, 1, os.getpid())
        close_row(reg, "r", topo, st, err)
    row = reg.get_run("r")
    assert (row["status"], row["error"]) == (status, error)


def test_topology_from_torchrun_and_slurm_environments():
    env = {"LOCAL_RANK": "1", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    t = detect_topology(env)
    assert (t.launcher, t.rank, t.local_rank, t.node_rank, t.num_nodes, t.is_node_leader) == \
        ("torchrun", 5, 1, 1, 2, False)
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77",
           "MASTER_ADDR": "node-a"}
    t = detect_topology(env)
    assert (t.launcher, t.rank, t.local_rank, t.world_size, t.local_world_size, t.node_rank) == \
        ("slurm", 6, 2, 8, 4, 1)
    # what torch.distributed and accelerate read
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == \
        ("6", "2", "8", "29577")
    assert derive_run_id(t, env=env) == "slurm-77-node1"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_topology({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "4",
                         "SLURM_STEP_NUM_NODES": "2"})
    with pytest.raises(ValueError, match="not a multiple"):
        detect_topology({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "3",
                         "SLURM_STEP_NUM_NODES": "2", "MASTER_ADDR": "a"})
    # the batch script itself (no srun step): one process, whatever the allocation's size
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "78"}
    assert detect_topology(batch).world_size == 1 and "RANK" not in batch
    solo = Topology("python", 0, 0, 1, 1, 0, 1, os.getpid())
    assert derive_run_id(solo) == derive_run_id(solo)  # every local rank derives the same id


def _slurm_env(tmp_path: Path, job_id: int, **extra) -> dict:
    env = job_env(tmp_path / "home")
    env["PATH"] = f"{DOUBLES}{os.pathsep}{env['PATH']}"
    env.update({"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost",
                "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1",
                "SCONTROL_DOUBLE_LOG": str(tmp_path / "scontrol.log")})
    env.update(extra)
    return env


@pytest.mark.timeout(900)
def test_slurm_preemption_requeues_and_the_next_attempt_resumes(tmp_path):
    """SIGUSR1 (Slurm's --signal=SIGUSR1@90) to every task → PreemptionGuard checkpoints and exits
    143 → srun returns 143 → the script requeues; the requeued attempt resumes from the checkpoint
    and continues the same registry row."""
    out_dir = tmp_path / "out"
    cfg = TrainConfig(max_steps=100_000, batch_size=8, num_workers=0, tensorboard=False,
                      output_dir=str(out_dir), checkpoint_every=0)
    export(cfg, "export_fns:train_until_preempted", "slurm", device="cpu", nproc_per_node=2,
           cpus_per_task=1, out_dir=tmp_path)
    run_dir = tmp_path / "home" / "runs" / "slurm-4343"
    job = subprocess.Popen(["bash", "train.sbatch"], cwd=tmp_path, env=_slurm_env(tmp_path, 4343),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        pid_files = [run_dir / "pids" / f"rank{r}.pid" for r in (0, 1)]
        wait_until(lambda: all(p.exists() for p in pid_files), 300, what="both ranks training")
        for p in pid_files:  # what --signal does: every task of the job step gets the signal
            os.kill(int(p.read_text()), signal.SIGUSR1)
        log, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, log[-3000:]
    assert "preempted (exit 143); requeueing" in log
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4343\n"
    reg = Registry(tmp_path / "home" / "registry.db")
    row = reg.get_run("slurm-4343")
    assert (row["status"], row["kind"]) == ("stopped", "slurm"), row
    assert "preempted by SIGUSR1" in row["error"]
    [ckpt] = sorted((out_dir / "checkpoints").iterdir())
    step = int(ckpt.name.split("_")[-1])

    # the requeued attempt: same job id; finish two steps after the checkpoint
    cfg2 = cfg.replace(max_steps=step + 2)
    (tmp_path / "config.json").write_text(cfg2.to_json())
    t_requeue = time.time()
    again = subprocess.run(["bash", "train.sbatch"], cwd=tmp_path,
                           env=_slurm_env(tmp_path, 4343, SLURM_RESTART_COUNT="1"),
                           capture_output=True, text=True, timeout=300, start_new_session=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    row = reg.get_run("slurm-4343")
    assert row["status"] == "succeeded" and row["error"] is None, row
    assert [r["id"] for r in reg.list_runs()] == ["slurm-4343"]
    for rank in (0, 1):
        steps = [m["step"] for m in reg.metrics("slurm-4343", "loss", rank) if m["t"] >= t_requeue]
        assert steps == [step + 1, step + 2], (rank, steps[:5])  # resumed, not restarted
