"""bench/gpu_check.py, the prepared GPU check: its dry run on this CPU (every step's CPU-safe part,
the wheels for the GPU machine), its runner's isolation (a failing, crashing, hanging or
process-leaking step is recorded and the next one runs), and its wheel checker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import gpu_check_steps  # noqa: E402


def _run(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


@pytest.mark.timeout(1500)
def test_dry_run_passes_every_steps_cpu_part(tmp_path):
    """What `make test` guarantees before a GPU session: everything imports, every step's CPU
    part passes, and .whl/ (make gpu-wheels) holds what the GPU image lacks."""
    out = _run("--dry-run", "--out", str(tmp_path), timeout=1400)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "dry-run"
    assert [s["name"] for s in report["steps"]] == [s.name for s in gpu_check_steps.STEPS]
    bad = {s["name"]: (s["status"], s["error"], [c for c in s["checks"] if not c["ok"]])
           for s in report["steps"] if s["status"] != "pass"}
    assert not bad, bad
    assert all(s["checks"] for s in report["steps"]), "every step checks something"
    assert report["wheels"]["ok"], report["wheels"]["problems"]
    assert report["wheels"]["total_bytes"] + (report["wheels"]["tree_bytes"] or 0) < 64 * 2**20
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "result: 13 passed, failed: none, not run: none" in text, text
    for step in gpu_check_steps.STEPS:  # the steps are listed first, with their CPU parts
        assert f"CPU: {step.cpu_part}" in out.stdout
    # the loader step ran the batch decoder on CPU tensors: equal to the CPU path, bit for bit
    loader = next(s for s in report["steps"] if s["name"] == "loader")
    assert loader["results"]["decode_difference"]["max_abs_diff"] == 0


STEPS_FILE = '''
import os, subprocess, sys, time
from gpu_check_steps import Step

def ok(ctx):
    ctx.record(value=42)
    ctx.check("fine", True, "yes")
    ctx.summary("all good")

def failing_check(ctx):
    ctx.check("wrong", False, "no")
    ctx.record(after=True)

def raises(ctx):
    ctx.record(before=1)
    raise RuntimeError("broke on purpose")

def crashes(ctx):
    os._exit(7)

def hangs(ctx):
    print("hanging", flush=True)
    time.sleep(600)

def leaks(ctx):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
    with open(os.environ["LEAKED_PID_FILE"], "w") as f:
        f.write(str(p.pid))
    ctx.check("started a process that outlives the step", True, p.pid)

STEPS = [Step(f.__name__, f.__name__, 2, f, "same") for f in
         (ok, failing_check, raises, crashes, hangs, leaks, ok)]
STEPS[-1] = Step("ok_again", "ok", 2, ok, "same")
'''


def test_runner_records_each_failure_and_goes_on(tmp_path):
    steps = tmp_path / "steps.py"
    steps.write_text(textwrap.dedent(STEPS_FILE))
    leaked = tmp_path / "leaked.pid"
    out = _run("--dry-run", "--steps-file", str(steps), "--out", str(tmp_path / "out"),
               "--wheels", str(tmp_path / "no-wheels"), timeout=180, LEAKED_PID_FILE=str(leaked))
    assert out.returncode == 1, out.stdout  # failures, and no wheels there
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    by = {s["name"]: s for s in report["steps"]}
    assert by["ok"]["status"] == "pass" and by["ok"]["results"] == {"value": 42}
    assert by["failing_check"]["status"] == "fail"
    assert by["failing_check"]["results"] == {"after": True}
    assert by["raises"]["status"] == "error"
    assert by["raises"]["error"] == "RuntimeError: broke on purpose"
    assert by["raises"]["results"] == {"before": 1}
    assert "broke on purpose" in by["raises"]["log_tail"]
    assert by["crashes"]["status"] == "crashed" and "exited 7" in by["crashes"]["error"]
    assert by["hangs"]["status"] == "timeout" and 8 <= by["hangs"]["seconds"] < 60
    assert "hanging" in by["hangs"]["log_tail"]
    assert by["leaks"]["status"] == "pass" and by["leaks"]["left_over_processes"] == 1
    assert by["ok_again"]["status"] == "pass"
    assert report["failed"] == ["failing_check", "raises", "crashes", "hangs"]
    assert report["wheels"]["problems"] == [f"{tmp_path / 'no-wheels'} does not exist: run "
                                            f"`make gpu-wheels`"]
    text = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert "failed check: wrong: no" in text
    # the process the step left behind (in a session of its own) was ended by the runner
    assert not psutil.pid_exists(int(leaked.read_text()))


def test_budget_leaves_the_last_steps_not_run(tmp_path):
    steps = tmp_path / "steps.py"
    steps.write_text(textwrap.dedent(STEPS_FILE))
    out = _run("--dry-run", "--steps-file", str(steps), "--out", str(tmp_path / "out"),
               "--only", "ok,hangs,ok_again", "--budget", "25", timeout=180, LEAKED_PID_FILE="")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    by = {s["name"]: s for s in report["steps"]}
    assert by["ok"]["status"] == "pass" and by["raises"]["summary"] == "not selected (--only)"
    assert by["hangs"]["status"] == "timeout"
    assert by["ok_again"]["status"] == "not run", out.stdout
    assert by["ok_again"]["summary"].startswith("not run:")
    assert "budget" in by["ok_again"]["summary"]


def _wheel(folder: Path, name: str, size: int = 10) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(b"x" * size)


def test_wheel_check_names_what_is_missing_doubled_misversioned_or_mistagged(tmp_path, monkeypatch):
    listing = tmp_path / "list.txt"
    listing.write_text("# comment\npyzmq==27.3.0\nzstandard==0.25.0\nplotly==7.1.0\nfoo-bar==1.0\n")
    monkeypatch.setattr(gpu_check, "WHEEL_LIST", listing)
    d = tmp_path / "whl"
    _wheel(d, "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl")
    _wheel(d, "zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    _wheel(d, "plotly-7.1.0-py3-none-any.whl")
    _wheel(d, "foo_bar-1.0-py3-none-any.whl")
    w = gpu_check.check_wheels(d)
    assert w["ok"], w["problems"]
    assert w["total_bytes"] == 40 and len(w["wheels"]) == 4

    _wheel(d, "plotly-6.0.0-py3-none-any.whl")                                   # two versions
    (d / "zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl").unlink()
    _wheel(d, "zstandard-0.25.0-cp311-cp311-manylinux2014_x86_64.whl")            # wrong Python
    (d / "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl").unlink()
    _wheel(d, "pyzmq-27.3.0-cp312-abi3-macosx_10_15_universal2.whl")             # wrong platform
    (d / "foo_bar-1.0-py3-none-any.whl").unlink()                                 # missing
    _wheel(d, "extra-2.0-py3-none-any.whl")                                       # not listed
    problems = "\n".join(gpu_check.check_wheels(d)["problems"])
    assert "plotly-6.0.0-py3-none-any.whl: version 6.0.0, list.txt wants 7.1.0" in problems
    assert "plotly: 2 wheels" in problems
    assert "zstandard-0.25.0-cp311-cp311-manylinux2014_x86_64.whl: tags" in problems
    assert "pyzmq-27.3.0-cp312-abi3-macosx_10_15_universal2.whl: tags" in problems
    assert "foo-bar==1.0 missing" in problems and "make gpu-wheels" in problems
    assert "extra-2.0-py3-none-any.whl: not in list.txt" in problems


def test_the_wheel_list_covers_what_the_gpu_image_lacks():
    """bench/gpu_wheels.txt holds the packages the issue names as missing on the GPU image, and a
    real kernel's needs (ipykernel, jupyter_client, nbclient), one version each."""
    want = gpu_check.wanted_wheels()
    for name in ("webdataset", "plotly", "ipywidgets", "pyzmq", "zstandard", "braceexpand",
                 "ipykernel", "jupyter-client", "nbclient", "nbformat", "tornado", "traitlets",
                 "jupyter-core", "anywidget"):
        assert name in want, name
    assert "torch" not in want and "torchvision" not in want  # the image has them


# --------------------------------------------------------------- the tutorials' GPU smoke lane

import gpu_notebook_steps  # noqa: E402


@pytest.mark.timeout(600)
def test_notebook_lane_dry_run_passes(tmp_path):
    """`make gpu-notebooks`'s dry run: every tutorial's packages lie in the GPU image or travel
    as wheels, and one tutorial runs through the lane's own path (nbclient, quick mode, its
    claim tables recorded) on this CPU."""
    out = _run("--lane", "notebooks", "--dry-run", "--out", str(tmp_path), timeout=560)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_notebooks.json").read_text())
    assert (report["lane"], report["mode"]) == ("notebooks", "dry-run")
    assert [s["name"] for s in report["steps"]] == ["packages", "01_environment_setup.one"]
    assert all(s["status"] == "pass" for s in report["steps"]), report["steps"]
    ran = report["steps"][1]["results"]
    assert ran["cells_run"] == ran["code_cells"] > 0 and ran["error"] is None
    assert "result: 2 passed, failed: none" in (tmp_path / "gpu_notebooks.txt").read_text()
    assert not (tmp_path / "gpu_check.json").exists()  # the lanes keep their own reports


@pytest.mark.parametrize("gpus, shapes", [(1, {"one": 15}), (8, {"one": 15, "all": 14})])
def test_the_lane_runs_every_notebook_on_one_gpu_and_the_rest_on_all(gpus, shapes):
    got: dict[str, int] = {}
    names = [s.name for s in gpu_notebook_steps.steps(gpus=gpus)]
    for name in names:
        got[name.rsplit(".", 1)[1]] = got.get(name.rsplit(".", 1)[1], 0) + 1
    assert got == shapes
    assert names[0] == "03_mixed_precision.one"  # Tensor Cores first: a budget cut spares them
    assert "00_overview.all" not in names


def test_a_measured_throughput_is_kept_for_the_tutorials_estimates(tmp_path, monkeypatch):
    from gpu_lab import estimate

    report = {"mode": "gpu", "started": "2026-12-07T12:00:00+00:00", "steps": [
        {"name": "gpu_train", "status": "pass", "results": {
            "gpu": "NVIDIA H200", "model": "resnet50", "rows": [{"variant": "bf16",
                                                                 "images_per_s": 3000.0}]}}]}
    assert gpu_check.keep_for_estimates({**report, "mode": "dry-run"}, str(tmp_path)) is None
    kept = gpu_check.keep_for_estimates(report, str(tmp_path / "home"))
    assert kept == tmp_path / "home" / "gpu_check.json" and kept.stat().st_mode & 0o077 == 0
    monkeypatch.delenv("GPU_LAB_GPU_CHECK", raising=False)
    monkeypatch.setenv("GPU_LAB_HOME", str(tmp_path / "home"))
    assert estimate.measured() == {"gpu": "NVIDIA H200", "images_per_s": 3000.0,
                                   "date": "2026-12-07"}
