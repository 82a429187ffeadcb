"""fit() on 2 gloo ranks in real processes: notebook_launcher, torchrun, and a SIGTERM preemption.

The training scripts are in train_dist_script.py. Every launch here is a fresh set of processes
(import torch + accelerate in each), so the file keeps to a handful of launches.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_dist_script as script
from gpu_lab.models import build
from gpu_lab.train import fit
from train_helpers import one_thread  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow,  # starts processes (ranks, kernels, servers) or runs for seconds
              pytest.mark.usefixtures("one_thread")]

SCRIPT = Path(script.__file__)
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _env(**extra) -> dict:
    env = dict(os.environ)
    # no run directory or rank of an outer launch
    for k in ("GPU_LAB_RUN_DIR", "GPU_LAB_EVENTS", "GPU_LAB_RUN_ID", "RANK", "WORLD_SIZE",
              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # one thread per rank: 2 ranks on a 2-core box
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list, timeout: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def _torchrun(mode: str, out: Path) -> subprocess.CompletedProcess:
    return _run([str(TORCHRUN), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                 "--master_port", str(_free_port()), str(SCRIPT), mode, str(out)])


def _params(path: Path) -> dict:
    return load_file(str(path))


def _assert_same(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"max difference {worst:.3g} > {atol}"
    return worst


@pytest.fixture(scope="module")
def notebook_launch(tmp_path_factory) -> Path:
    """One notebook_launcher launch of 2 ranks that runs the "accum" then the "zero" script."""
    out = tmp_path_factory.mktemp("notebook_launch")
    _run([sys.executable, str(SCRIPT), "notebook", "accum,zero", str(out), "2"])
    return out


def test_grad_accumulation_on_two_gloo_ranks_equals_one_batch_of_32(notebook_launch, tmp_path):
    """notebook_launcher, 2 ranks × 4 micro-batches × 4 samples vs 1 process × batch 32."""
    out = notebook_launch / "accum"
    summary = json.loads((out / "summary_rank0.json").read_text())
    assert summary["num_processes"] == 2 and summary["global_batch"] == 32
    r0, r1 = _params(out / "rank0.safetensors"), _params(out / "rank1.safetensors")
    _assert_same(r0, r1, 0)  # a real process group: the ranks hold one model, not two

    ref_cfg = script.config("accum", tmp_path / "one").replace(batch_size=32, grad_accum_steps=1)
    torch.manual_seed(ref_cfg.seed)
    from accelerate.utils import set_seed

    set_seed(ref_cfg.seed)
    ref = build(ref_cfg.model, ref_cfg.num_classes, ref_cfg.image_size)
    initial = {k: p.detach().clone() for k, p in ref.named_parameters()}
    fit(ref, script.FixedImages(), ref_cfg)
    ref_params = {k: p.detach() for k, p in ref.named_parameters()}
    assert max((ref_params[k] - initial[k]).abs().max().item() for k in initial) > 1e-3
    worst = _assert_same(r0, ref_params, 1e-5)
    print(f"\n2 ranks × 4 × 4 vs 1 × 32: max parameter difference {worst:.2e}")


def test_sigterm_preemption_exits_143_and_resume_is_exact(tmp_path):
    """A 2-rank run gets SIGTERM on both ranks at step 6: both save one checkpoint and exit 143.
    Resumed under torchrun it ends where an uninterrupted torchrun run ends, bit for bit."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    first = _torchrun("resume", straight)  # resume=True, but there is nothing to resume: 12 steps
    assert "resuming from" not in first.stdout

    port = _free_port()
    procs = []
    for rank in range(2):  # the ranks as a scheduler starts them (torchrun's environment)
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "hold", str(interrupted)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        deadline = time.monotonic() + 180
        while not all((interrupted / f"reached_rank{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks never reached the preemption step"
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)  # the spot-instance notice, to every rank
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [p.stdout.read() for p in procs]
    assert codes == [143, 143], logs
    assert "preempted by SIGTERM at step 6" in logs[0]
    saved = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    assert saved == ["step_000000006"]
    state = json.loads((interrupted / "checkpoints" / saved[0] / "trainer_state.json").read_text())
    assert (state["reason"], state["epoch"], state["batch_in_epoch"]) == ("preempt", 1, 4)

    resumed = _torchrun("resume", interrupted)
    # a headless run says so in its terminal, once (rank 0)
    assert resumed.stdout.count(f"resuming from step 6 ({interrupted / 'checkpoints'}") == 1, \
        resumed.stdout[-3000:]
    summary = json.loads((interrupted / "summary_rank0.json").read_text())
    assert summary["resumed_from"].endswith("step_000000006") and summary["steps"] == 12
    final_a = _params(straight / "checkpoints" / "step_000000012" / "model.safetensors")
    final_b = _params(interrupted / "checkpoints" / "step_000000012" / "model.safetensors")
    _assert_same(final_a, final_b, 1e-6)
    _assert_same(_params(interrupted / "rank0.safetensors"), _params(interrupted / "rank1.safetensors"), 0)


def test_zero_and_powersgd_on_two_ranks(notebook_launch):
    out = notebook_launch / "zero"
    _assert_same(_params(out / "rank0.safetensors"), _params(out / "rank1.safetensors"), 0)
    info = json.loads((out / "fit_info_rank0.json").read_text())
    assert info["optimizer"] == "ZeroRedundancyOptimizer"
    assert "powerSGD" in info["comm_hook"]
    # the ZeRO shards were consolidated on rank 0: the checkpoint holds state for every parameter
    ckpt = out / "checkpoints" / "step_000000006"
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    n_params = len(_params(out / "rank0.safetensors"))
    assert len(opt["state"]) == n_params
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000003",
                                                                       "step_000000006"]
