"""The host's shape and the sizes that follow it, in every shape: one GPU, eight GPUs, one CPU slot
and several; and the verdict of a measurement that needs more devices than the host has."""
from __future__ import annotations

import contextlib
import json

import pytest

from gpu_lab import machine, tutorial
from gpu_lab.telemetry import probe
from gpu_lab.telemetry.doubles import FakeGPU, FakeNVML


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, cc=(9, 0)): this process sees n fake GPUs through NVML."""
    def make(n: int, cc: tuple = (9, 0), name: str = "Fake H100 80GB HBM3") -> FakeNVML:
        nv = FakeNVML([FakeGPU(name=name, uuid=f"GPU-{i}", compute_capability=cc) for i in range(n)])

        @contextlib.contextmanager
        def session(nvml=None):
            nv.nvmlInit()
            try:
                yield nv, None
            finally:
                nv.nvmlShutdown()

        monkeypatch.setattr(probe, "gpu_count", lambda: n)
        monkeypatch.setattr(probe, "nvml_session", session)
        return nv
    return make


@pytest.fixture
def cores(monkeypatch):
    def make(n: int) -> None:
        monkeypatch.setattr(machine, "_cores", lambda: n)
    return make


@pytest.mark.parametrize("slots, ranks", [(1, 1), (2, 2), (64, 2)])
def test_cpu_ranks_follow_the_slots(monkeypatch, gpus, slots, ranks):
    gpus(0)
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", str(slots))
    assert machine.default_ranks() == tutorial.ranks() == ranks
    here = machine.shape()
    assert (here.kind, here.devices, here.unit) == ("cpu", slots, "CPU slot")
    assert "no GPU" in tutorial.machine_line()


@pytest.mark.parametrize("n", [1, 8])
def test_gpu_ranks_are_the_gpus_whatever_the_slots(monkeypatch, gpus, n):
    gpus(n)
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "1")
    assert machine.default_ranks() == n
    here = machine.shape()
    assert (here.kind, here.devices, here.count()) == ("gpu", n, f"{n} GPU{'s' if n > 1 else ''}")
    assert "Fake H100" in here.describe()


@pytest.mark.parametrize("cc, want", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 0), "fp16")])
def test_precision_is_what_the_gpu_runs_natively(gpus, cc, want):
    gpus(1, cc=cc)
    assert machine.precision() == want


def test_precision_is_fp32_on_a_cpu(gpus):
    gpus(0)
    assert machine.precision() == "no"


@pytest.mark.parametrize("n_cores, ranks, want", [(2, 1, 1), (2, 2, 0), (16, 8, 1), (128, 8, 8),
                                                  (96, 1, 8), (1, 1, 0)])
def test_loader_workers_come_from_the_cores_per_rank(cores, n_cores, ranks, want):
    cores(n_cores)
    assert machine.loader_workers(ranks) == want


def test_loader_workers_refuse_no_ranks():
    with pytest.raises(ValueError, match="ranks: got 0"):
        machine.loader_workers(0)


def test_sweep_parallel_is_the_free_devices(monkeypatch, gpus, tmp_path):
    from gpu_lab.supervise.claims import wait_for_devices

    gpus(0)
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "4")
    assert machine.sweep_parallel() == 4
    assert machine.sweep_parallel(2) == 2 and machine.sweep_parallel(cap=3) == 3
    held = wait_for_devices(3, "someone-else", queue=False)  # another run holds three slots
    try:
        assert machine.free_devices() == 1
        assert machine.sweep_parallel() == 1 and machine.sweep_parallel(2) == 1  # at least one
    finally:
        held.release()
    assert machine.sweep_parallel() == 4
    with pytest.raises(ValueError, match="ranks_per_trial"):
        machine.sweep_parallel(0)


# ------------------------------------------------------------- a measurement that needs devices

@pytest.mark.parametrize("slots", [1, 2])
def test_a_multi_device_row_names_what_it_needs_and_what_the_host_has(monkeypatch, gpus, slots):
    gpus(0)
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", str(slots))
    d = tutorial.needs_devices(2, "scaling efficiency")
    assert bool(d) == (slots >= 2)
    v = d.verdict(tutorial.at_least(0.9, 0.5, "noise")) if d else d.verdict()
    assert f"needs 2 CPU slots; this host has {slots}" in v.reason and (v.need, v.have) == (2, slots)
    assert v.label == (tutorial.HOLDS if d else tutorial.NEEDS_DEVICES)
    assert v.measured == bool(d)
    assert ("not measured here" in str(d)) != bool(d)


def test_a_met_need_requires_the_measurement(monkeypatch, gpus):
    gpus(2)
    d = tutorial.needs_devices(2, "PowerSGD")
    assert "needs 2 GPUs; this host has 2" in str(d)
    with pytest.raises(ValueError, match="pass the measured verdict"):
        d.verdict()
    with pytest.raises(ValueError, match="need: got 0"):
        tutorial.needs_devices(0, "x")


def test_claim_tables_append_their_rows_where_asked(monkeypatch, gpus, tmp_path):
    gpus(0)
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "1")
    out = tmp_path / "verdicts.jsonl"
    monkeypatch.setenv(tutorial.VERDICTS_VARIABLE, str(out))
    d = tutorial.needs_devices(2, "ZeRO-1")
    tutorial.ClaimTable([tutorial.Claim("ZeRO", "-65%", "not measured", "B", d.verdict()),
                         tutorial.Claim("AdamW", "8 B", "8 B", "def", tutorial.arithmetic("definition"))])
    tutorial.ClaimTable([tutorial.Claim("more", "x", "y", "z", "holds")])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["what"], r["label"], r["need"], r["have"]) for r in rows] == [
        ("ZeRO", tutorial.NEEDS_DEVICES, 2, 1), ("AdamW", tutorial.ARITHMETIC, None, None),
        ("more", "holds", None, None)]
    assert out.stat().st_mode & 0o077 == 0  # the user's own file


# ------------------------------------------------------------------ a notebook's full-mode time
# (slow: FLOPs are counted on models torch builds on the meta device)

@pytest.mark.slow
def test_full_mode_time_is_an_estimate_from_flops_where_nothing_was_measured(monkeypatch, tmp_path):
    from gpu_lab import estimate

    monkeypatch.setenv("GPU_LAB_GPU_CHECK", str(tmp_path / "none.json"))
    one = estimate.full_mode([estimate.Work("resnet50", 224, 1000, 64, ranks=1)])
    assert not one.measured and "estimate from FLOPs" in str(one)
    # 64,000 ResNet-50 images at NVIDIA's A100 figure, plus the run's start
    assert one.one_gpu_s == pytest.approx(64_000 / estimate.REFERENCE_IMG_S + estimate.RUN_START_S)
    assert one.eight_gpu_s == one.one_gpu_s  # a 1-rank run uses one GPU of eight
    big = estimate.full_mode([estimate.Work("resnet50", 448, 1000, 64, ranks=1)])
    assert big.one_gpu_s > 3 * (one.one_gpu_s - estimate.RUN_START_S)  # 4x the pixels
    tiny = estimate.full_mode([estimate.Work("tiny_cnn", 32, 1000, 64)])
    assert tiny.one_gpu_s == pytest.approx(1000 * estimate.MIN_STEP_S + estimate.RUN_START_S)


@pytest.mark.slow
def test_a_sweep_spreads_over_eight_gpus_and_ddp_keeps_its_steps(monkeypatch, tmp_path):
    from gpu_lab import estimate

    monkeypatch.setenv("GPU_LAB_GPU_CHECK", str(tmp_path / "none.json"))
    sweep = estimate.full_mode([estimate.Work("resnet50", 224, 500, 64, ranks=1, runs=16,
                                              parallel=True)])
    assert sweep.one_gpu_s == pytest.approx(8 * sweep.eight_gpu_s)  # 16 waves against 2
    ddp = estimate.full_mode([estimate.Work("resnet50", 224, 500, 64)])  # a batch per GPU
    assert ddp.eight_gpu_s > ddp.one_gpu_s  # the same steps, a little communication more
    with pytest.raises(ValueError, match="batch ≥ 1"):
        estimate.full_mode([estimate.Work("resnet50", 224, 10, 0)])


@pytest.mark.slow
def test_full_mode_time_uses_this_machines_gpu_check(monkeypatch, tmp_path):
    from gpu_lab import estimate

    check = tmp_path / "gpu_check.json"
    check.write_text(json.dumps({"started": "2026-12-07T10:00:00+00:00", "steps": [
        {"name": "gpu_train", "results": {"gpu": "NVIDIA H100 80GB HBM3", "model": "resnet50",
                                          "rows": [{"variant": "fp32", "images_per_s": 900.0},
                                                   {"variant": "bf16", "images_per_s": 4940.0}]}}]}))
    monkeypatch.setenv("GPU_LAB_GPU_CHECK", str(check))
    assert estimate.measured() == {"gpu": "NVIDIA H100 80GB HBM3", "images_per_s": 4940.0,
                                   "date": "2026-12-07"}
    e = estimate.full_mode([estimate.Work("resnet50", 224, 1000, 64, ranks=1)])
    assert e.measured and "this machine's GPU check" in str(e) and "H100" in str(e)
    assert e.one_gpu_s == pytest.approx(64_000 / 4940 + estimate.RUN_START_S)
