"""Your own training code, unchanged: a script written the way accelerate's examples are (argparse,
a bare Accelerator, accelerator.log, save_state; never importing gpu_lab) launched from a real
kernel by its path and as a module, queued, stopped, detached; a bare Accelerator() in a launched
function forms the run's group; and every way a script can end, each with a clear status."""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import gpu_lab
from gpu_lab.record.registry import Registry
from gpu_lab.record.recorder import NO_METRICS
from gpu_lab.record.runfolder import RunFolder
from gpu_lab.rank.script import Script, ScriptError

from proc_utils import alive, tree, wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).parent
SCRIPT = TESTS / "own_code" / "train_accel.py"
EXITS = TESTS / "own_code" / "exits.py"


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _said(cell) -> dict:
    return json.loads(_stdout(cell).strip().splitlines()[-1])


KERNEL = [
    """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import gpu_lab, own_helper
from proc_utils import tree, alive, wait_until
from gpu_lab.record.registry import Registry
OUT = {out!r}
""",
    # by its path, with its arguments: the call returns while the ranks train
    """
run = gpu_lab.launch("own_code/train_accel.py", "--lr", "0.05", "--steps", "20",
                     "--out", OUT + "/path", num_processes=2)
print(json.dumps({"done": run.done, "status": run.status}))
""",
    """
def seen(run, out):
    status = run.wait(180)
    row = Registry().get_run(run.id)
    return {"status": status, "error": str(run.error) if run.error else None,
            "ranks": [json.load(open(f"{out}/rank{r}.json")) for r in (0, 1)],
            "steps": [m["step"] for m in Registry().metrics(run.id, "loss", rank=0)],
            "lr": [m["value"] for m in Registry().metrics(run.id, "lr", rank=0)][:1],
            "config": row["config"], "name": row["name"],
            "atexit": sorted(os.listdir(out)),
            "in_kernel": sorted(m for m in sys.modules if "train_accel" in m),
            "kernel_pid": os.getpid()}
print(json.dumps(seen(run, OUT + "/path")))
""",
    # the same as a module, from the kernel's working directory (tests/)
    """
run = gpu_lab.launch("-m", "own_code.train_accel", "--lr", "0.05", "--steps", "20",
                     "--out", OUT + "/module", num_processes=2)
print(json.dumps(seen(run, OUT + "/module")))
""",
    # a module the kernel imported must not stand in for the script's own
    """
run = gpu_lab.launch("own_code/shadowed.py", num_processes=2)
print(json.dumps({"status": run.wait(120), "kernel": own_helper.WHOSE,
                  "mine": [m["value"] for m in Registry().metrics(run.id, "mine", rank=0)]}))
""",
    # stop (a module this time): SIGTERM reaches it; the run is stopped and nothing is left
    """
run = gpu_lab.launch("-m", "own_code.train_accel", "--lr", "0.01", "--steps", "100000", "--pace",
                     "0.05", "--out", OUT + "/stop", num_processes=2)
assert run.wait_for_step(3, rank=0, timeout=120), run.status
procs = tree(run.pid)
status = run.stop()
wait_until(lambda: not alive(procs), 15, what="the run's processes to end")
notes = [e["data"]["text"] for e in Registry().events(run.id, kinds=["log"])]
print(json.dumps({"status": status, "n": len(procs), "reason": run.reason,
                  "said": [n for n in notes if "no checkpoint was written by gpu_lab" in n]}))
""",
    # the host's queue: with two CPU slots, a second script waits for the first
    """
os.environ["GPU_LAB_CPU_SLOTS"] = "2"
os.environ["GPU_LAB_CLAIMS_DIR"] = OUT + "/claims"
first = gpu_lab.launch("own_code/train_accel.py", "--lr", "0.01", "--steps", "100000", "--pace",
                       "0.05", "--out", OUT + "/first", num_processes=2)
second = gpu_lab.launch("own_code/train_accel.py", "--lr", "0.01", "--steps", "5",
                        "--out", OUT + "/second", num_processes=2)
wait_until(lambda: second.status == "queued", 30, what="the second run's place")
queued = (second.status, second.queue_position)
assert first.wait_for_step(2, rank=0, timeout=120), first.status
ahead = second.status
first.stop()
print(json.dumps({"queued": queued, "while_first_runs": ahead, "first": first.status,
                  "second": second.wait(180)}))
""",
    # detach (a module): the run outlives this kernel
    """
run = gpu_lab.launch("-m", "own_code.train_accel", "--lr", "0.01", "--steps", "40", "--pace",
                     "0.05", "--out", OUT + "/detached", num_processes=2, detach=True)
assert run.wait_for_step(1, rank=0, timeout=120), run.status
print(json.dumps({"id": run.id}))
""",
]


def test_a_kernel_runs_an_unchanged_accelerate_script(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{tests!r}", repr(str(TESTS))).replace(
        "{out!r}", repr(str(tmp_path)))) for c in KERNEL]
    NotebookClient(nb, timeout=400, kernel_name="python3",
                   resources={"metadata": {"path": str(TESTS)}}).execute()
    said = [_said(c) for c in nb.cells[1:]]
    launched, by_path, by_module, shadow, stopped, queue, detached = said

    assert launched == {"done": False, "status": launched["status"]}, launched
    for run in (by_path, by_module):
        assert run["status"] == "succeeded", run["error"]
        assert [r["num_processes"] for r in run["ranks"]] == [2, 2]
        assert [r["process_index"] for r in run["ranks"]] == [0, 1]
        assert {r["distributed_type"] for r in run["ranks"]} == {"MULTI_CPU"}
        assert all(r["name"] == "__main__" and not r["interactive"] for r in run["ranks"])
        assert run["steps"] == list(range(20)) and run["lr"] == [0.05]  # every step it logged
        assert run["config"]["lr"] == 0.05 and run["config"]["steps"] == 20  # init_trackers'
        assert {"atexit0", "atexit1", "state"} <= set(run["atexit"])  # atexit ran, state saved
        assert run["in_kernel"] == []  # the kernel compiled it, never imported or ran it
        assert run["kernel_pid"] not in [r["pid"] for r in run["ranks"]]
    assert by_path["ranks"][0]["argv"] == ["--lr", "0.05", "--steps", "20", "--out",
                                           by_path["ranks"][0]["argv"][-1]]
    assert by_path["name"] == "train_accel.py" and by_module["name"] == "own_code.train_accel"
    assert shadow == {"status": "succeeded", "kernel": "the kernel's", "mine": [1.0]}, shadow
    assert stopped["status"] == "stopped" and stopped["n"] >= 3, stopped
    assert stopped["reason"] == "stopped by the user"
    assert stopped["said"], stopped  # whether it saved anything is the script's affair: said so
    assert queue["queued"] == ["queued", 1] and queue["while_first_runs"] == "queued", queue
    assert queue["first"] == "stopped" and queue["second"] == "succeeded", queue
    # the kernel is gone; the detached run goes on to its end
    run = gpu_lab.attach(detached["id"])
    assert run.wait(180) == "succeeded", run.reason
    assert [m["step"] for m in Registry().metrics(run.id, "loss", rank=0)] == list(range(40))


def _launch(*args, **kw):
    run = gpu_lab.launch(*args, num_processes=kw.pop("num_processes", 2), **kw)
    return run, run


def _running(run) -> list:
    """What is left of the run's processes: its supervisor and every rank that started."""
    import psutil

    pids = [run.pid, *RunFolder(run.run_dir).rank_pids().values()]
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _first_line(run) -> str:
    return str(run.error).splitlines()[0]


@pytest.mark.parametrize("mode", ["exit0", "exit-none"])
def test_sys_exit_0_and_none_succeed(mode):
    run, procs = _launch(str(EXITS), mode)
    assert run.wait(120) == "succeeded", run.error
    wait_until(lambda: not _running(procs), 15, what="no process left")


def test_a_script_that_logs_nothing_says_how_to_log():
    run, _ = _launch(str(EXITS), "exit0")
    assert run.wait(120) == "succeeded"
    notes = [e["data"]["text"] for e in Registry().events(run.id, kinds=["log"]) if e["rank"] == -1]
    assert notes == [NO_METRICS]


@pytest.mark.parametrize("mode,first", [
    ("exit3", "SystemExit(3): exited with code 3; its last output: exits.py: exit3 [user code]"),
    ("exit-text", "SystemExit(1): the data folder is empty [user code]"),
])
def test_a_script_that_exits_with_an_error_fails_saying_so(mode, first):
    run, procs = _launch(str(EXITS), mode)
    assert run.wait(120) == "failed"
    assert _first_line(run) in (f"rank 0: {first}", f"rank 1: {first}"), str(run.error)
    wait_until(lambda: not _running(procs), 15, what="no process left")


def test_an_argparse_error_fails_with_argparse_s_message(tmp_path):
    run, procs = _launch(str(SCRIPT), "--lr", "fast", "--out", str(tmp_path))
    assert run.wait(120) == "failed"
    assert _first_line(run)[len("rank 0: "):] == (
        "SystemExit(2): train_accel.py: error: argument --lr: invalid float value: 'fast' "
        "[user code]")
    assert "usage: train_accel.py" in str(run.error)  # what to try names the usage
    wait_until(lambda: not _running(procs), 15, what="no process left")


def test_bad_scripts_are_refused_before_anything_starts(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def train(:\n    pass\n")
    before = len(Registry().list_runs())
    with pytest.raises(ScriptError, match=r"broken\.py, line 1: .*syntax error"):
        gpu_lab.launch(str(broken))
    with pytest.raises(ScriptError, match=r"script 'no_such_train\.py' not found"):
        gpu_lab.launch("no_such_train.py", "--lr", "0.1")
    with pytest.raises(ScriptError, match=r"module 'no_such_pkg' not found"):
        gpu_lab.launch("-m", "no_such_pkg.train")
    with pytest.raises(ScriptError, match=r"arguments are strings"):
        gpu_lab.launch(str(SCRIPT), "--lr", [0.1])
    assert len(Registry().list_runs()) == before  # no run was made


@pytest.mark.parametrize("mode", ["ignore-sigterm", "own-handler"])
def test_a_script_that_handles_or_ignores_sigterm_is_still_stopped(mode):
    run, _ = _launch(str(EXITS), mode)
    wait_until(lambda: "ready" in run.logs(1), 120, what="the script to install its handler")
    procs = tree(run.pid)
    assert run.stop(grace=2.0) == "stopped", run.error
    wait_until(lambda: not alive(procs) and not _running(run), 15, what="nothing left running")


def test_a_bare_accelerator_forms_the_launch_s_group():
    import launch_fns

    run = gpu_lab.launch(launch_fns.bare_accelerator, num_processes=2)
    res = run.result(120)
    assert res["distributed_type"] == "MULTI_CPU" and res["num_processes"] == res["world"] == 2
    assert [m["value"] for m in Registry().metrics(run.id, "loss", rank=0)] == [1.0]
    assert run.metrics.ranks() == [0]  # accelerate logs on the main process only


def test_a_rank_that_sees_another_world_size_fails_naming_why():
    import launch_fns

    run = gpu_lab.launch(launch_fns.accelerator_without_cpu_switch, num_processes=2)
    assert run.wait(120) == "failed"
    assert "WorldSizeMismatch: accelerate sees 1 process(es) (DistributedType.NO), but gpu_lab " \
           "started 2 ranks" in _first_line(run)


@pytest.mark.parametrize("how", ["spawn", "start_processes", "notebook-launcher"])
def test_code_that_starts_its_own_ranks_is_refused(how):
    import launch_fns

    if how == "notebook-launcher":
        run = gpu_lab.launch(str(EXITS), "notebook-launcher", num_processes=2)
    else:  # torch.multiprocessing.start_processes: what Lightning's ddp_spawn and ddp_notebook use
        run = gpu_lab.launch(launch_fns.spawns_its_own_ranks, how, num_processes=2)
    assert run.wait(120) == "failed"
    assert "RanksInRanks" in _first_line(run) and "would start ranks of its own" in \
        _first_line(run), str(run.error)


def test_resume_launches_the_script_again_with_its_own_flag(tmp_path):
    run = gpu_lab.launch(str(SCRIPT), "--lr", "0.05", "--steps", "3", "--out", str(tmp_path),
                         num_processes=1)
    assert run.wait(120) == "succeeded"
    again = gpu_lab.attach(run.id).resume("--steps", "5")  # argparse: the last --steps wins
    assert again.wait(120) == "succeeded", again.error
    assert [m["step"] for m in Registry().metrics(again.id, "loss", rank=0)] == list(range(5))
    assert again.name == run.name


def test_the_script_and_its_arguments_stay_in_the_owner_only_run_folder(tmp_path):
    secret = "--token=s3cret-value"
    script = Script.parse(str(EXITS), ("exit0", secret))
    assert script.argv == ("exit0", secret) and script.name == "exits.py"
    run = gpu_lab.launch(script, num_processes=1)
    assert run.wait(120) == "succeeded"
    target = Path(run.run_dir, "target.json")
    assert json.loads(target.read_text())["argv"] == ["exit0", secret]
    assert target.stat().st_mode & 0o077 == 0
    assert Registry().get_run(run.id)["entry"] is None  # nothing readable elsewhere names it


def test_script_targets_are_parsed_as_a_terminal_would(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)
    s = Script.parse("-m", ("own_code.train_accel", "--lr", 0.1))
    assert s.module == "own_code.train_accel" and s.argv == ("--lr", "0.1")
    assert s.origin == str(SCRIPT) and s.command == "python -m own_code.train_accel --lr 0.1"
    assert Script.parse("-m own_code.train_accel").module == "own_code.train_accel"
    with pytest.raises(ScriptError, match="'-m' needs a module name"):
        Script.parse("-m")
    with pytest.raises(ScriptError, match="is a module, not a package"):
        Script.parse("-m", ("own_code.train_accel.sub",))
    with pytest.raises(ScriptError, match="without a __main__.py"):
        Script.parse("-m", ("own_code",))
    assert os.path.isabs(Script.parse("own_code/exits.py").path)


@pytest.mark.parametrize("how,mode,status", [
    ("accelerate launch", "end", "succeeded"),
    ("python", "exit", "succeeded"),
    ("python", "fail", "failed"),
])
def test_a_run_gpu_lab_did_not_start_is_recorded_by_its_tracker(tmp_path, how, mode, status):
    """`Accelerator(log_with=gpu_lab.Tracker())` in a script run by accelerate launch (2 ranks
    that form a gloo group with accelerate's CPU switch) or by python: rank 0 records the run."""
    import subprocess
    import sys

    home = tmp_path / "home"
    env = dict(os.environ, GPU_LAB_HOME=str(home), ACCELERATE_USE_CPU="true")
    script = str(TESTS / "own_code" / "tracked.py")
    cmd = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
            "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            script, mode] if how == "accelerate launch" else [sys.executable, script, mode])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert (out.returncode == 0) == (status == "succeeded"), out.stderr[-2000:]
    reg = Registry(home / "registry.db")
    (row,) = reg.list_runs()
    assert row["status"] == status, row
    assert row["kind"] == ("torchrun" if how == "accelerate launch" else "python")
    assert row["config"] == {"lr": 0.1, "mode": mode}
    assert [m["value"] for m in reg.metrics(row["id"], "loss", rank=0)] == \
        [1.0, 0.5, 1 / 3, 0.25, 0.2]
    if status == "failed":
        assert "ValueError: the data ran out" in row["error"]
