"""gpu_lab.sweep on real processes: a driver interpreter, Optuna's study in SQLite, every trial a
gpu_lab.launch run of tiny_cnn on synthetic images in the host queue (4 CPU slots, 1-rank trials,
2 at a time), ASHA at Optuna's defaults."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.record.registry import Registry

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

optuna = pytest.importorskip("optuna", reason="gpu_lab.sweep needs optuna (a dependency)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A home, a host queue of 4 CPU slots and quick synthetic data, for this test and the
    processes it starts (the driver inherits them)."""
    monkeypatch.setenv("GPU_LAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "4")
    monkeypatch.setenv("GPU_LAB_QUICK", "1")
    return tmp_path


def tiny(tmp_path: Path) -> gpu_lab.TrainConfig:
    """A trial of a few seconds: 20 steps, evaluated every 5."""
    return gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=20,
                               eval_every=5, num_workers=0, tensorboard=False, num_processes=1,
                               output_dir=str(tmp_path / "out"))


SPACE = {"lr": gpu_lab.loguniform(1e-4, 1e-1), "optimizer": ["adamw", "sgd"]}


def test_a_bad_space_is_refused_before_any_trial(host):
    cfg = tiny(host)
    cases = [({"lrr": [0.1]}, "'lrr'", "Did you mean 'lr'"),
             ({"lr": [1e-3, 20.0]}, "'lr', value 20.0", "<= 10.0"),
             ({"batch_size": gpu_lab.uniform(0, 64)}, "'batch_size'", ">= 1"),
             ({"optimizer": ["adam"]}, "'optimizer'", "'adamw', 'sgd'"),
             ({"lr": 0.1}, "'lr'", "gpu_lab.loguniform")]
    for space, field, accepted in cases:
        with pytest.raises(ValueError) as e:
            gpu_lab.sweep(gpu_lab.train_classifier, cfg, space, trials=2)
        assert field in str(e.value) and accepted in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="pruner=.ashx.; accepted: .asha."):
        gpu_lab.sweep(gpu_lab.train_classifier, cfg, SPACE, pruner="ashx")
    assert Registry().list_runs() == []
    assert not (host / "home" / "sweeps").exists() or not any((host / "home" / "sweeps").iterdir())


def test_a_study_that_cannot_be_created_fails_the_sweep_with_the_reason(host):
    """sweep() returns before the study exists (a thread creates it): a storage that cannot be
    opened is the sweep's state, failed, with the reason; no driver, no trial."""
    sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(host), SPACE, trials=2,
                       storage=f"sqlite:///{host}/no-such-folder/sweeps.db")
    assert sw.wait(timeout=120) == "failed"
    assert "could not be created" in sw.error and "no-such-folder" in sw.error, sw.error
    assert sw._proc is None and Registry().list_runs() == []


def test_a_process_opens_each_storage_once(host):
    """A kernel's sweep() and its Sweep handles share one storage: its engine and schema check
    cost about a second the first time."""
    from gpu_lab.sweep import study as st

    url = st.default_storage()
    assert st.storage_of(url) is st.storage_of(url)


def test_the_driver_is_woken_by_a_trial_run_ending():
    """The driver's loop waits on an event that each trial's run sets when it ends, so the next
    trial starts then rather than at the next read of the records."""
    import threading
    import types

    from gpu_lab.sweep.driver import Driver

    end = threading.Event()
    run = types.SimpleNamespace(id="r", wait=lambda timeout=None: end.wait(timeout))
    driver = types.SimpleNamespace(_wake=threading.Event())
    Driver._watch(driver, run)
    assert not driver._wake.is_set()
    end.set()
    assert driver._wake.wait(60)


def test_the_driver_reads_only_the_new_points_of_its_metric(tmp_path):
    """Each poll reads past the last seq read and decodes only rank 0's events naming the metric
    (not accuracy_top5, not rank 1's)."""
    reg = Registry(tmp_path / "registry.db")
    reg.create_run("r", status="running")
    reg.add_events("r", [{"rank": 0, "kind": "metric", "t": 1.0, "step": s,
                          "data": {"loss": 1.0 / s}} for s in range(1, 50)] + [
        {"rank": 0, "kind": "metric", "t": 2.0, "step": 10, "data": {"accuracy": 0.5, "loss": 0.1}},
        {"rank": 1, "kind": "metric", "t": 2.0, "step": 10, "data": {"accuracy": 0.4}},
        {"rank": 0, "kind": "metric", "t": 2.0, "step": 11, "data": {"accuracy_top5": 0.9}}])
    seq, points = reg.metric_points("r", "accuracy")
    assert points == [(10, 0.5)] and seq == reg.last_seq("r") == 52
    assert reg.metric_points("r", "accuracy", after=seq) == (seq, [])
    reg.add_events("r", [{"rank": 0, "kind": "metric", "t": 3.0, "step": 20,
                          "data": {"accuracy": 0.75}}])
    assert reg.metric_points("r", "accuracy", after=seq) == (seq + 1, [(20, 0.75)])
    assert reg.metric_points("r", "accuracy", rank=1)[1] == [(10, 0.4)]


@pytest.mark.timeout(900)
def test_twelve_trials_two_at_a_time_with_asha(host):
    t0 = time.monotonic()
    sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(host), SPACE, trials=12, parallel=2,
                       metric="accuracy", direction="maximize", pruner="asha", sampler_seed=0)
    assert time.monotonic() - t0 < 10, "sweep() must return at once"
    assert sw.wait(timeout=800) == "finished", Path(sw.spec["storage"][10:]).parent.joinpath(
        "sweeps", sw.id, "driver.log").read_text()[-3000:]

    study = optuna.load_study(study_name=sw.id, storage=f"sqlite:///{host}/home/sweeps.db")
    states = [t.state for t in study.trials]
    assert len(states) == 12
    # the kernel drew the first two, the driver the rest with the same sampler, not a new one
    # seeded alike (which would draw the first two again)
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == 12, study.trials
    assert all(s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
               for s in states), states
    reg = Registry()
    tagged = [r for r in reg.list_runs() if r.get("sweep") == sw.id]
    assert len(tagged) == 12
    pruned = [r for r in tagged if r["status"] == "pruned"]
    assert pruned, [r["status"] for r in tagged]
    assert states.count(optuna.trial.TrialState.PRUNED) == len(pruned)
    from gpu_lab.train.resume import find_checkpoint

    for r in pruned:
        assert find_checkpoint(r["output_dir"]).step > 0, r
        assert "pruned by sweep" in r["reason"]
        ends = [e["data"] for e in reg.events(r["id"], kinds=["status"])]
        assert "stopped" not in json.dumps(ends), ends  # recorded as pruned: notices say so
    best = sw.best
    assert best.value == max(t.value for t in study.trials if t.value is not None)
    assert best.config.lr == best.params["lr"] and best.config.optimizer == best.params["optimizer"]
    assert best.run in {r["id"] for r in tagged}
    rows = sw.trials
    assert [r["status"] for r in rows].count("pruned") == len(pruned)
    assert all(r["best"] is not None and r["last"] is not None for r in rows)
    print(f"\n{len(pruned)} of 12 trials pruned; best {best.value:.3f} with {best.params}")

    view = gpu_lab.SweepView(sw, top=3)  # the notebook's view of it, built from the same records
    assert view.table.value.count("<tr>") == 13 and view.table.value.count("pruned") >= len(pruned)
    dims = view.parallel_figure.data[0].dimensions
    assert [d.label for d in dims] == ["lr", "optimizer", "accuracy", "pruned"]
    assert len(dims[0].values) == 12
    assert len(view.curves_figure.data) == 3
    assert len(view.parallel.children) == len(view.curves.children) == 1


KERNEL = """
import sys, gpu_lab
sys.path.insert(0, {tests!r})
from test_sweep import tiny, SPACE
from pathlib import Path
sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(Path({tmp!r})), SPACE, trials=4, parallel=2,
                   detach=True)
print(sw.id, flush=True)
sys.stdin.read()  # a kernel at rest until it is killed
"""

FOLLOWER = """
import json, gpu_lab
sw = gpu_lab.attach({sweep_id!r})
state = sw.wait(timeout=600)
print(json.dumps({{"state": state, "kind": type(sw).__name__, "trials": sw.trials}}))
"""


def _python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, **kw)


@pytest.mark.timeout(900)
def test_a_detached_sweep_outlives_a_sigkilled_kernel(host):
    kernel = _python(KERNEL.format(tests=str(ROOT / "tests"), tmp=str(host)),
                     stdin=subprocess.PIPE)
    sweep_id = kernel.stdout.readline().strip()
    assert sweep_id.startswith("sweep-"), sweep_id
    sw = gpu_lab.attach_sweep(sweep_id)
    deadline = time.monotonic() + 300
    while not any(r["status"] in ("running", "complete") for r in sw.trials):
        assert time.monotonic() < deadline and sw.state == "running", sw.trials
        time.sleep(0.2)
    os.kill(kernel.pid, signal.SIGKILL)
    kernel.wait(10)
    follower = _python(FOLLOWER.format(sweep_id=sweep_id))
    out, _ = follower.communicate(timeout=700)
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["kind"] == "Sweep" and seen["state"] == "finished", seen
    assert len(seen["trials"]) == 4
    assert all(t["status"] in ("complete", "pruned") for t in seen["trials"]), seen["trials"]
    assert len([r for r in Registry().list_runs() if r.get("sweep") == sweep_id]) == 4


def _driver_running_a_trial(sw) -> int:
    deadline = time.monotonic() + 300
    while not any(r["status"] == "running" and r["step"] for r in sw.trials):
        assert time.monotonic() < deadline and sw.state == "running", sw.trials
        time.sleep(0.2)
    return int(sw.study.user_attrs["driver_pid"])


@pytest.mark.timeout(900)
def test_a_sweep_whose_driver_died_resumes_its_study(host):
    sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(host), SPACE, trials=4, parallel=2,
                       detach=True, pruner=None)
    os.kill(_driver_running_a_trial(sw), signal.SIGKILL)
    sw._proc.wait(10)
    assert sw.state == "lost"
    left = [r["trial"] for r in sw.trials if r["status"] == "running"]
    assert left
    assert sw.resume().wait(timeout=600) == "finished"
    rows = sw.trials
    assert len(rows) == 4 and all(r["status"] == "complete" for r in rows), rows
    assert all(rows[n]["value"] is not None for n in left)  # followed to their end, not redone
    assert len([r for r in Registry().list_runs() if r.get("sweep") == sw.id]) == 4


@pytest.mark.timeout(600)
def test_stop_ends_the_running_trials_and_asks_for_no_more(host):
    sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(host), SPACE, trials=8, parallel=2)
    _driver_running_a_trial(sw)
    assert sw.stop(timeout=300) == "stopped"
    runs = [r for r in Registry().list_runs() if r.get("sweep") == sw.id]
    assert len(runs) <= 4 and all(r["status"] in ("stopped", "succeeded") for r in runs), runs
    assert len(sw.study.trials) == len(runs)


@pytest.mark.timeout(600)
def test_seeds_make_one_trial_of_several_runs_valued_by_their_mean(host):
    cfg = tiny(host)
    sw = gpu_lab.sweep(gpu_lab.train_classifier, cfg, {"lr": [3e-3]}, trials=1, seeds=2,
                       parallel=1, pruner=None)
    assert sw.wait(timeout=500) == "finished"
    (row,) = sw.trials
    assert len(row["runs"]) == 2
    reg = Registry()
    seeds = sorted(reg.get_run(r)["config"]["seed"] for r in row["runs"])
    assert seeds == [cfg.seed, cfg.seed + 1]
    lasts = [reg.metrics(r, name="accuracy", rank=0)[-1]["value"] for r in row["runs"]]
    assert row["value"] == pytest.approx(sum(lasts) / 2)
    with pytest.raises(ValueError, match="'seed' with seeds>1"):
        gpu_lab.sweep(gpu_lab.train_classifier, cfg, {"seed": [1, 2]}, seeds=2)


DIES_BEFORE_HANDING_OVER = """
import os, signal, sys, gpu_lab
sys.path.insert(0, {tests!r})
from test_sweep import tiny, SPACE
from pathlib import Path
from gpu_lab.sweep.handle import Sweep
# killed as a kernel can be, after it asked for the first trials, before the driver had them
Sweep._hand_over = staticmethod(lambda proc, what: os.kill(os.getpid(), signal.SIGKILL))
sw = gpu_lab.sweep(gpu_lab.train_classifier, tiny(Path({tmp!r})), SPACE, trials=3, parallel=2,
                   detach=True, pruner=None, sampler="random", sampler_seed=0)
print(sw.id, flush=True)
sw._opening.join()
"""


@pytest.mark.timeout(600)
def test_trials_a_dying_kernel_asked_for_are_run_by_the_driver(host):
    """The kernel asks for the first trials while the driver imports torch, then hands them over;
    killed in between, the driver reads nothing and runs those trials itself, with their params,
    and draws the rest past them."""
    kernel = _python(DIES_BEFORE_HANDING_OVER.format(tests=str(ROOT / "tests"), tmp=str(host)))
    sweep_id = kernel.stdout.readline().strip()
    assert kernel.wait(60) == -signal.SIGKILL
    sw = gpu_lab.attach_sweep(sweep_id)
    asked = [dict(t.params) for t in sw.study.trials]
    assert len(asked) == 2, asked  # asked by the kernel, never handed over
    assert sw.wait(timeout=400) == "finished", sw.trials
    rows = sw.trials
    assert [r["status"] for r in rows] == ["complete"] * 3, rows
    assert [r["params"] for r in rows[:2]] == asked
    assert rows[2]["params"] not in asked
    assert len([r for r in Registry().list_runs() if r.get("sweep") == sweep_id]) == 3


UNDETACHED = KERNEL.replace("detach=True", "detach=False")


@pytest.mark.timeout(600)
def test_a_sweep_not_detached_ends_with_its_kernel(host):
    kernel = _python(UNDETACHED.format(tests=str(ROOT / "tests"), tmp=str(host)),
                     stdin=subprocess.PIPE)
    sw = gpu_lab.attach(kernel.stdout.readline().strip())
    _driver_running_a_trial(sw)
    os.kill(kernel.pid, signal.SIGKILL)
    kernel.wait(10)
    assert sw.wait(timeout=300) == "stopped"
    runs = [r for r in Registry().list_runs() if r.get("sweep") == sw.id]
    assert runs and all(r["status"] in ("stopped", "succeeded") for r in runs), runs
