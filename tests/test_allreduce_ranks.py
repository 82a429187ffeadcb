"""allreduce_bench on a host with one device: num_processes=None would launch one rank, which has
no peers and no process group; the benchmark refuses before it launches anything, naming the
devices it needs and the devices the host has. No process starts here."""
from __future__ import annotations

import contextlib

import pytest

from gpu_lab import launch as launch_pkg
from gpu_lab.diagnostics import allreduce_bench
from gpu_lab.telemetry import probe
from gpu_lab.telemetry.doubles import FakeGPU, FakeNVML


@pytest.fixture
def host(monkeypatch):
    """host(gpus, slots): this process sees `gpus` fake GPUs and `slots` CPU slots; a launch fails."""
    def make(gpus: int, slots: int = 1) -> None:
        nv = FakeNVML([FakeGPU(name="Fake H100 80GB HBM3", uuid=f"GPU-{i}") for i in range(gpus)])

        @contextlib.contextmanager
        def session(nvml=None):
            nv.nvmlInit()
            try:
                yield nv, None
            finally:
                nv.nvmlShutdown()

        monkeypatch.setattr(probe, "gpu_count", lambda: gpus)
        monkeypatch.setattr(probe, "nvml_session", session)
        monkeypatch.setenv("GPU_LAB_CPU_SLOTS", str(slots))

        def no_launch(*a, **k):
            raise AssertionError("allreduce_bench launched ranks on a host with one device")

        monkeypatch.setattr(launch_pkg, "launch", no_launch)
    return make


@pytest.mark.parametrize("gpus, words", [(0, "2 CPU slots; this host has 1 CPU slot"),
                                         (1, "2 GPUs; this host has 1 GPU")])
def test_the_default_ranks_on_one_device_are_refused_with_the_devices_named(host, gpus, words):
    host(gpus, slots=1)
    with pytest.raises(ValueError) as e:
        allreduce_bench([1024])
    assert "an all-reduce needs 2 ranks" in str(e.value) and words in str(e.value)
    assert "num_processes=None gives 1 rank" in str(e.value)


def test_one_rank_asked_for_is_refused_too(host):
    host(0, slots=2)
    with pytest.raises(ValueError, match="num_processes: got 1; accepted: >= 2"):
        allreduce_bench([1024], num_processes=1)
