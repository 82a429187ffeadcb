"""gpu_lab.launch on 2 real gloo ranks, from the test process (the kernel test repeats the core
of this from a real Jupyter kernel)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.launch import PreflightError, free_port
from gpu_lab.launch.checks import port_in_use
from gpu_lab.launch.testing import fake_cuda_state
from gpu_lab.record.registry import Registry

import launch_fns
from proc_utils import alive, tree, wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


def test_two_ranks_form_a_group_and_return_rank0_value():
    from gpu_lab.launch.checks import real_cuda_probe

    poisoned = real_cuda_probe().fork_poisoned
    run = gpu_lab.launch(launch_fns.train_linear, 8, num_processes=2, name="linear")
    assert run.status in ("pending", "running")  # returned before the training ended
    assert run.wait(120) == "succeeded", run.logs(None) + run.logs(0) + run.logs(1)
    res = run.result()
    assert res["distributed_type"] == "MULTI_CPU"
    assert res["num_processes"] == 2
    p0, p1 = res["params"]
    assert p0 == pytest.approx(p1, abs=1e-7), "DDP ranks ended with different parameters"
    assert run.metrics.ranks() == [0, 1]
    for rank in (0, 1):
        steps, losses = run.metrics.series("loss", rank)
        assert steps == list(range(8))
        _, bad = run.metrics.series("bad_fork", rank)
        # workers are in CUDA's bad-fork state exactly when this process poisoned its forks
        # (earlier in-process tests may have run optimizer steps); the kernel test checks a clean one
        assert bad and set(bad) == {float(poisoned)}
    row = Registry().get_run(run.id)
    assert row["status"] == "succeeded"
    assert {m["rank"] for m in Registry().metrics(run.id, "loss")} == {0, 1}
    assert "linear" in repr(run) and "succeeded" in repr(run)


def test_elastic_logs_stay_in_the_run_and_ranks_keep_the_temp_dir():
    """torch elastic makes a torchelastic_ folder per launch in the temp dir and never removes it;
    gpu_lab puts it in the run's folder, and the user's code still sees the usual temp dir."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("torchelastic_*"))
    run = gpu_lab.launch(launch_fns.train_linear, 2, num_processes=2)
    assert run.wait(120) == "succeeded", run.logs(None)
    assert set(tmp.glob("torchelastic_*")) == before
    assert list((run.run_dir / "elastic").glob("torchelastic_*"))
    assert run.result()["tempdir"] == str(tmp)


def test_stop_ends_the_whole_tree_and_frees_the_port():
    run = gpu_lab.launch(launch_fns.train_forever, num_processes=2)
    assert run.wait_for_step(3, rank=1, timeout=60), run.status
    procs = tree(run.pid)
    assert len(procs) >= 3, procs  # supervisor + 2 workers
    assert port_in_use(run.port)
    assert run.stop() == "stopped"
    wait_until(lambda: not alive(procs), 10, what="every process of the run to end")
    assert not port_in_use(run.port)
    assert Registry().get_run(run.id)["status"] == "stopped"


def test_a_stop_may_end_the_run_as_pruned_and_no_reader_sees_stopped():
    """A sweep prunes with stop(status="pruned"): the end is recorded as pruned at once, so notices
    and readers never see an intermediate `stopped`; any other status is refused by name."""
    run = gpu_lab.launch(launch_fns.train_forever, num_processes=1)
    assert run.wait_for_step(2, timeout=60), run.status
    with pytest.raises(ValueError, match=r"status='paused'; accepted: 'stopped', 'pruned'"):
        run.stop(status="paused")
    assert run.status == "running"
    assert run.stop(reason="pruned by a test", status="pruned") == "pruned"
    row = Registry().get_run(run.id)
    assert row["status"] == "pruned" and row["reason"] == "pruned by a test", row
    seen = [e["data"] for e in Registry().events(run.id, kinds=["status"])]
    assert "stopped" not in json.dumps(seen), seen


def test_wait_for_step_wakes_on_reports_and_says_when_the_run_ended_first():
    run = gpu_lab.launch(launch_fns.train_linear, 6, num_processes=2)
    assert run.wait_for_step(3, rank=1, timeout=120)
    assert max(run.metrics.series("loss", 1)[0]) >= 3
    assert run.wait_for_step(10**6, timeout=120) is False  # the run ended at step 5
    assert run.status == "succeeded"
    forever = gpu_lab.launch(launch_fns.train_forever, num_processes=1)
    try:
        with pytest.raises(TimeoutError, match=r"did not report 'nope' at step 1 within 0.01 s"):
            forever.wait_for_step(1, metric="nope", timeout=0.01)
    finally:
        assert forever.stop() == "stopped"


def test_an_unpicklable_result_is_recorded_and_explained():
    """Not a failed run: the run succeeded, the rank's log and the run's record say why there is
    no value, and result() raises with the reason (the same outcome as a headless run's)."""
    from gpu_lab.record import events as ev

    run = gpu_lab.launch(launch_fns.returns_unpicklable, num_processes=1)
    assert run.wait(120) == "succeeded", run.logs(0)
    with pytest.raises(gpu_lab.launch.RunFailedError,
                       match=r"rank 0's return value could not be pickled: function: .*lambda"):
        run.result()
    assert "could not be pickled" in run.logs(0)
    notes = Registry().last_events(run.id, [ev.LOG], 10)
    assert any("could not be pickled" in e["data"]["text"] for e in notes), notes


def test_rank_exception_fails_the_run_with_its_traceback():
    run = gpu_lab.launch(launch_fns.rank1_raises, num_processes=2)
    assert run.wait(120) == "failed"
    procs = tree(run.pid)
    assert not alive(procs)
    err = run.error
    assert 1 in err.ranks
    f = err[1]
    assert f.type == "ValueError"
    assert "rank one broke on purpose" in f.message
    assert "rank1_raises" in f.traceback and "Traceback" in f.traceback
    assert f.category == "user code"
    assert "rank 1: ValueError" in str(err)
    with pytest.raises(gpu_lab.launch.RunFailedError, match="rank one broke"):
        run.result()
    assert Registry().get_run(run.id)["status"] == "failed"


def test_sigkilled_worker_fails_with_a_clear_message():
    run = gpu_lab.launch(launch_fns.rank1_sigkilled, num_processes=2)
    assert run.wait(120) == "failed"
    err = run.error
    f = err[1]
    assert f.type == "SIGKILL"
    assert "killed by SIGKILL" in f.message
    assert f.category == "killed by a signal"
    assert any("out-of-memory killer" in s for s in f.suggestions)
    wait_until(lambda: not alive(tree(run.pid)), 10, what="no process left")


def test_launch_works_while_29500_is_taken():
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 29500))
        except OSError:
            pass  # already held by something else: the point stands
        s.listen()
        run = gpu_lab.launch(launch_fns.train_linear, 2, num_processes=2)
        assert run.port != 29500
        assert run.wait(120) == "succeeded"
    finally:
        s.close()


def test_free_port_is_bindable():
    p = free_port()
    assert not port_in_use(p)


def test_preflight_refuses_an_accelerator_made_in_the_kernel():
    from accelerate.state import AcceleratorState, PartialState

    PartialState(cpu=True)
    try:
        with pytest.raises(PreflightError, match="inside the training function"):
            gpu_lab.launch(launch_fns.train_linear, num_processes=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("state,needle", [
    (dict(initialized=True), "CUDA is already initialised"),
    (dict(bad_fork=True), "bad-fork"),
])
def test_preflight_refuses_cuda_in_the_kernel(state, needle):
    # No GPU on this machine: a named test double stands in for torch's CUDA state.
    with fake_cuda_state(**state) as probe:
        with pytest.raises(PreflightError, match=needle) as ei:
            gpu_lab.launch(launch_fns.train_linear, num_processes=2)
    assert probe.calls == 1
    assert "restart the kernel" in str(ei.value).lower() or "fresh kernel" in str(ei.value)


def test_preflight_refuses_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    with pytest.raises(PreflightError, match="bitsandbytes"):
        gpu_lab.launch(launch_fns.train_linear, num_processes=2)


def test_logs_are_captured_per_rank():
    def noisy():
        import sys as _s

        acc = gpu_lab.accelerator()
        print(f"hello from rank {acc.process_index}")
        print(f"warning from rank {acc.process_index}", file=_s.stderr)
        return acc.process_index

    run = gpu_lab.launch(noisy, num_processes=2)
    assert run.wait(120) == "succeeded"
    assert run.result() == 0
    for r in (0, 1):
        text = run.logs(r, tail=100)
        assert f"hello from rank {r}" in text and f"warning from rank {r}" in text
    assert "gpu_lab supervisor" in run.logs(None)


def test_lost_run_is_marked(gpu_lab_home):
    reg = Registry()
    reg.create_run("ghost", name="ghost", status="running")
    reg.update("ghost", pid=2**22 - 3, pid_started=1.0)  # no such process
    assert reg.get_run("ghost")["status"] == "lost"
    assert gpu_lab.runs()[0]["status"] == "lost"


def test_preempted_ranks_make_a_stopped_run_not_a_failed_one():
    run = gpu_lab.launch(launch_fns.preempted_at_step, 2, num_processes=2)
    assert run.wait(120) == "stopped"
    assert run.error is None
    assert "preempted" in (run.run_dir / "status.json").read_text()


def test_fork_poisoning_is_detected_through_a_child():
    # torch.cuda.is_available() leaves is_initialized() False but poisons every later fork
    code = ("import torch; from gpu_lab.launch.checks import real_cuda_probe as p; a = p(); "
            "torch.cuda.is_available(); b = p(); print(a.fork_poisoned, b.fork_poisoned, "
            "b.initialized)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "False"]


def test_poisoned_fork_is_refused_for_gpu_workers_only():
    from gpu_lab.launch import checks

    with fake_cuda_state(fork_poisoned=True):
        with pytest.raises(PreflightError, match="bad-fork state and cannot use a GPU"):
            checks.preflight("cuda")
        checks.preflight("cpu")  # CPU workers never touch CUDA: allowed


def test_cpu_launch_works_after_torch_asked_for_cuda_in_the_kernel():
    # a fresh interpreter plays the kernel: asking torch for CUDA marks every later fork of the
    # asking process as poisoned, and this test process forks on (other tests check it does not)
    probe = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
             "import torch, gpu_lab, launch_fns\n"
             "torch.cuda.is_available()  # what an optimizer step in a cell does behind your back\n"
             "run = gpu_lab.launch(launch_fns.train_linear, 2, num_processes=2)\n"
             "status = run.wait(120)\n"
             "print(status, run.error)\n"
             "sys.exit(0 if status == 'succeeded' else 1)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_run_never_finalizes_the_kernels_garbage(tmp_path):
    """A kernel's garbage may hold SQLite connections; finalizing one in a fork of it takes
    SQLite's allocator lock, which another kernel thread may have held at the fork, and the run
    hung for good. The run collects only its own objects; the kernel's stay the kernel's."""
    import gc

    marks = tmp_path / "finalized"

    class Cycle:
        def __del__(self):
            with open(marks, "a") as f:
                f.write(f"{os.getpid()}\n")

    gc.disable()  # the garbage is still there at the fork
    try:
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        run = gpu_lab.launch(launch_fns.collects_garbage, num_processes=1)
    finally:
        gc.enable()
    assert run.wait(120) == "succeeded", run.logs(None)
    gc.collect()
    assert marks.read_text().split() == [str(os.getpid())] * 2


def test_a_launch_waits_for_a_kernel_thread_that_imports():
    """A thread importing at the fork leaves its modules' import locks held in the run, which
    then hangs on its first import of one of them (a sweep's opening imports Optuna while the
    next cell may launch): the launch lets such a thread finish first."""
    import threading

    from gpu_lab.launch.launcher import IMPORTING

    started = threading.Event()

    def importing():
        started.set()
        time.sleep(1.0)  # as long as a first `import optuna`

    t = threading.Thread(target=importing, name=IMPORTING + "test")
    t.start()
    started.wait()
    run = gpu_lab.launch(launch_fns.collects_garbage, num_processes=1)
    assert not t.is_alive()
    assert run.wait(120) == "succeeded", run.logs(None)
