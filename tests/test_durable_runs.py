"""Runs that outlive the kernel: the run keeps its own record, any kernel attaches, no metric is
lost, and the launching kernel's death ends a run only when it was not detached.

Real Jupyter kernels (jupyter_client) launch 2 gloo ranks; the tests kill them (SIGKILL), shut them
down (a shutdown request, as Kernel → Restart does), kill the supervisor, and read the registry.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.record.registry import Registry
from gpu_lab.train.resume import ResumeMismatchError

from kernel_utils import Kernel
from proc_utils import alive, tree, wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).parent
STEPS = 120


def _launch(kernel: Kernel, tmp_path: Path, *, detach: bool, name: str, steps: int = STEPS,
            pace: float = 0.05) -> dict:
    """Launch a paced 2-rank fit() from the kernel; wait until both ranks train."""
    return kernel.json(f"""
cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=8, max_steps={steps},
                          num_workers=0, tensorboard=False, output_dir={str(tmp_path / "out")!r})
run = gpu_lab.launch(launch_fns.fit_params, cfg, {pace}, num_processes=2, detach={detach},
                     name={name!r})
assert run.wait_for_step(5, rank=1, timeout=120), run.logs(None)
print(json.dumps({{"id": run.id, "pid": run.pid, "output_dir": run.output_dir}}))
""")


def _steps(reg: Registry, run_id: str, rank: int) -> list[int]:
    return [m["step"] for m in reg.metrics(run_id, "loss", rank)]


def _checkpoints(output_dir: str) -> list[str]:
    d = Path(output_dir) / "checkpoints"
    return sorted(p.name for p in d.glob("step_*")) if d.is_dir() else []


def test_kernel_killed_detached_run_ends_and_a_new_kernel_attaches(kernels, tmp_path):
    k1 = kernels()
    info = _launch(k1, tmp_path, detach=True, name="outlives-its-kernel")
    procs = tree(info["pid"])
    k1.kill()
    k2 = kernels()
    seen = k2.json(f"""
r = gpu_lab.attach({info["id"]!r})
history = r.metrics.count("loss", 0)
status_then = r.status
assert r.wait(300) == "succeeded", (r.status, r.reason)
print(json.dumps({{"history": history, "status_then": status_then,
                   "rank0": r.metrics.series("loss", 0)[0], "rank1": r.metrics.series("loss", 1)[0],
                   "dropped": r.dropped}}))
""", timeout=320)
    assert seen["status_then"] == "running" and 5 <= seen["history"] < STEPS  # attached mid-run
    expected = list(range(1, STEPS + 1))
    assert seen["rank0"] == expected and seen["rank1"] == expected  # history + live, no gap/dup
    assert seen["dropped"] == 0
    reg = Registry()
    assert _steps(reg, info["id"], 0) == expected and _steps(reg, info["id"], 1) == expected
    row = reg.get_run(info["id"])
    assert row["status"] == "succeeded" and row["detach"] == 1
    wait_until(lambda: not alive(procs), 30, what="the run's processes to end")


def test_kernel_killed_undetached_run_checkpoints_and_stops(kernels, tmp_path):
    k = kernels()
    info = _launch(k, tmp_path, detach=False, name="ends-with-its-kernel", steps=100_000)
    procs = tree(info["pid"])
    assert len(procs) >= 3
    k.kill()
    wait_until(lambda: not alive(procs), 10, what="the ranks to checkpoint and exit within 10 s")
    row = Registry().get_run(info["id"])
    assert row["status"] == "stopped" and row["reason"] == "the launching kernel exited"
    saved = _checkpoints(info["output_dir"])
    assert saved, "the ranks did not checkpoint"
    last = max(_steps(Registry(), info["id"], 0))
    assert saved[-1] == f"step_{last:09d}"  # the step they had reached


def test_graceful_shutdown_keeps_detached_runs_and_stops_the_others(kernels, tmp_path):
    k = kernels()
    kept = _launch(k, tmp_path, detach=True, name="detached", steps=400)
    ended = _launch(k, tmp_path, detach=False, name="attached-to-kernel", steps=100_000)
    ended_procs, kept_procs = tree(ended["pid"]), tree(kept["pid"])
    k.shutdown()
    wait_until(lambda: not alive(ended_procs), 15, what="the undetached run to stop")
    reg = Registry()
    row = reg.get_run(ended["id"])
    assert row["status"] == "stopped" and row["reason"] == "the launching kernel exited"
    assert _checkpoints(ended["output_dir"])
    assert reg.get_run(kept["id"])["status"] == "running" and alive(kept_procs)
    other = gpu_lab.attach(kept["id"])
    step = max(_steps(reg, kept["id"], 0))
    assert other.wait_for_step(step + 3, timeout=60)  # it trains on after the shutdown
    assert other.stop() == "stopped" and other.reason == "stopped by the user"
    wait_until(lambda: not alive(kept_procs), 15, what="the detached run's processes to end")


def test_killed_supervisor_is_lost_for_every_reader_and_leaves_nothing(kernels, tmp_path):
    k = kernels()
    info = _launch(k, tmp_path, detach=False, name="supervisor-killed", steps=100_000)
    here = gpu_lab.attach(info["id"])  # a second reader, in another process
    procs = tree(info["pid"])
    os.kill(info["pid"], signal.SIGKILL)
    assert here.wait(10) == "lost"
    seen = k.json("assert run.wait(10) == 'lost'; print(json.dumps({'status': run.status}))")
    assert seen == {"status": "lost"}
    wait_until(lambda: not alive(procs), 15, what="the ranks to follow their supervisor")
    assert Registry().get_run(info["id"])["status"] == "lost"


# --- resume on purpose -------------------------------------------------------------------------------
def _cfg(tmp_path: Path, **kw) -> gpu_lab.TrainConfig:
    base = dict(model="tiny_cnn", image_size=16, batch_size=8, max_steps=12, num_workers=0,
                tensorboard=False, output_dir=str(tmp_path / "runs"), warmup_ratio=0.2)
    return gpu_lab.TrainConfig(**{**base, **kw})


def test_each_run_has_its_own_checkpoints_and_a_mismatched_resume_is_refused(tmp_path):
    import launch_fns

    a = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path, model="tiny_resnet"), name="a")
    assert a.wait(300) == "succeeded"
    b = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path), name="b")  # same folder, other model
    assert b.wait(300) == "succeeded", b.error
    assert a.output_dir != b.output_dir
    assert _checkpoints(a.output_dir) == _checkpoints(b.output_dir) == ["step_000000012"]
    assert b.result()["resumed_from"] is None  # nothing of a's was picked up
    before = len(Registry().list_runs())
    with pytest.raises(ResumeMismatchError, match=r"model: checkpoint 'tiny_resnet', this config "
                                                  r"'tiny_cnn'"):
        gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path), resume=a)
    assert len(Registry().list_runs()) == before  # refused before anything started


def test_resume_on_purpose_continues_at_the_exact_step(tmp_path):
    import launch_fns

    straight = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path), name="straight")
    assert straight.wait(300) == "succeeded"
    first = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path), 0.2, name="interrupted")
    assert first.wait_for_step(4, rank=1, timeout=120)
    assert first.stop() == "stopped"  # SIGTERM: the ranks checkpoint at the next step
    stopped_at = int(_checkpoints(first.output_dir)[-1].split("_")[1])
    assert 4 <= stopped_at < 12
    second = first.resume()
    assert second.wait(300) == "succeeded", second.error
    assert second.resumed_from == {"run": first.id, "step": stopped_at,
                                   "path": str(Path(first.output_dir) / "checkpoints" /
                                               f"step_{stopped_at:09d}")}
    summary = second.result()
    assert summary["steps"] == 12 and summary["resumed_from"] == second.resumed_from["path"]
    assert second.metrics.series("loss", 0)[0][0] == stopped_at + 1  # the next step, not step 1
    assert f"resuming from step {stopped_at} (" in second.logs(0, tail=None)
    assert summary["params"] == straight.result()["params"]  # bit for bit
    row = Registry().get_run(second.id)
    assert row["resumed_from"]["run"] == first.id and row["output_dir"] != first.output_dir


def test_runs_table_and_compare(tmp_path):
    import launch_fns

    a = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path, max_steps=6), name="cmp")
    b = gpu_lab.launch(launch_fns.fit_params, _cfg(tmp_path, max_steps=6, lr=3e-3), name="cmp")
    assert a.wait(300) == b.wait(300) == "succeeded"
    table = gpu_lab.runs(name="cmp")
    # still rows, newest first (by when each started: under load the second may start first)
    assert [r["id"] for r in table] == [r["id"] for r in sorted(
        table, key=lambda r: r["started"], reverse=True)] and {a.id, b.id} == {
        r["id"] for r in table}
    text = str(table)
    assert text.splitlines()[0].split() == ["id", "name", "status", "ranks", "precision",
                                            "step", "loss", "started", "duration", "note"]
    assert a.id in text and "succeeded" in text and "<table>" in table._repr_html_()
    assert gpu_lab.runs(status="failed", name="cmp") == []
    fig = gpu_lab.compare(table, metric="loss", x="step")
    assert fig.layout.legend.title.text == "differs in: lr"
    assert sorted(t.name for t in fig.data) == ["lr=0.001", "lr=0.003"]
    assert [list(t.x) for t in fig.data] == [[1, 2, 3, 4, 5, 6]] * 2
    assert len(gpu_lab.compare([a.id, b.id], x="time").data) == 2
    with pytest.raises(ValueError, match="none of these runs reported 'nope'"):
        gpu_lab.compare([a, b], metric="nope")


def test_a_run_is_followed_in_the_registry_it_was_launched_with(tmp_path, monkeypatch):
    """The process-wide receiver was made under one GPU_LAB_HOME; a run launched under another is
    recorded there, and its handle still follows it (seen: a server test switched homes and its
    run stayed 'pending' while it trained)."""
    import launch_fns
    from gpu_lab.readers.receiver import get_receiver

    assert get_receiver().registry.path.parent != tmp_path / "elsewhere"
    monkeypatch.setenv("GPU_LAB_HOME", str(tmp_path / "elsewhere"))
    run = gpu_lab.launch(launch_fns.train_linear, 5, num_processes=2)
    assert run.wait(120) == "succeeded"
    assert run.metrics.count("loss", 1) == 5
