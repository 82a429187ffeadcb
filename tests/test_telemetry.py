"""Telemetry: the NVML sampler (against the FakeNVML double on CPU machines, the real NVML on a
GPU host), the psutil host sampler, and the one shared sampler thread."""
from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from gpu_lab.telemetry import (GPU_FIELDS, HOST_FIELDS, HostSampler, NVMLSampler, Sampler,
                               get_sampler, resolve_visible)
from gpu_lab.telemetry import sampler as sampler_mod
from gpu_lab.telemetry.doubles import FakeGPU, FakeNVML
from gpu_lab.telemetry.probe import gpu_count

UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000", "GPU-dddd4444-0000"]


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# --- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    (None, [0, 1, 2, 3]),
    ("", []),
    ("-1", []),
    ("2,0", [2, 0]),
    ("1, 3", [1, 3]),
    ("0,7,1", [0]),                          # CUDA stops at the first invalid entry
    ("1,1,2", [1, 2]),                       # a device listed twice counts once
    ("GPU-cccc3333-0000,0", [2, 0]),         # full UUIDs
    ("GPU-dddd,GPU-aaaa", [3, 0]),           # unique prefixes
    ("bbbb2222", [1]),                       # without the GPU- prefix
    ("GPU-,1", []),                          # ambiguous prefix: invalid, stop
])
def test_resolve_visible(spec, expected):
    assert resolve_visible(spec, UUIDS) == expected


def test_device_order_follows_cuda_visible_devices():
    fake = FakeNVML([FakeGPU(uuid=u, name=f"board {i}") for i, u in enumerate(UUIDS)])
    s = NVMLSampler(nvml=fake, visible="GPU-dddd,1")
    gpus = s.sample()
    assert [(g["index"], g["nvml_index"], g["uuid"]) for g in gpus] == [
        (0, 3, UUIDS[3]), (1, 1, UUIDS[1])]
    assert [d.name for d in s.devices] == ["board 3", "board 1"]


def test_device_order_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    s = NVMLSampler(nvml=FakeNVML([FakeGPU(uuid=u) for u in UUIDS]))
    assert [g["nvml_index"] for g in s.sample()] == [2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = NVMLSampler(nvml=FakeNVML([FakeGPU(uuid=u) for u in UUIDS]))
    assert not s.available and "CUDA_VISIBLE_DEVICES=''" in s.reason


# --- the NVML sampler against the double -------------------------------------------------------
def _check_types(entry: dict, fields: dict, allow_none=()):
    for name, (typ, _unit, _help) in fields.items():
        assert name in entry, f"{name} missing"
        v = entry[name]
        if name in allow_none:
            assert v is None or isinstance(v, typ), f"{name}={v!r}"
            continue
        assert v is not None, f"{name} is None"
        assert isinstance(v, typ) and not isinstance(v, bool), f"{name}={v!r} is not {typ.__name__}"


def test_every_gpu_field_populated_and_typed():
    assert len(GPU_FIELDS) >= 20
    clock = Clock()
    fake = FakeNVML([FakeGPU(uuid="GPU-x", nvlinks=4, processes={4242: 3 * 1024**3, 99: 1024**3})])
    s = NVMLSampler(nvml=fake, visible=None, clock=clock)
    assert s.calls == 0 and fake.calls == {}  # lazy: nothing happens before the first sample
    first = s.sample(pids=[4242])[0]
    fake.gpus[0].nvlink_kib[:] = [2_000_000, 1_000_000]  # cumulative KiB counters move on
    clock.t += 2.0
    g = s.sample(pids=[4242])[0]
    _check_types(g, GPU_FIELDS)
    assert first["nvlink_tx_mbps"] == 0.0  # no rate before the second sample
    assert g["util_gpu"] == 85.0 and g["util_mem"] == 40.0
    assert g["mem_total_mb"] == 80 * 1024 and g["mem_used_mb"] == 20 * 1024
    assert g["mem_free_mb"] == 60 * 1024 and g["mem_used_pct"] == 25.0
    assert g["power_w"] == 350.0 and g["power_limit_w"] == 700.0  # NVML's mW converted
    assert g["clock_sm_mhz"] == 1755.0 and g["clock_sm_max_mhz"] == 1980.0
    assert g["pcie_rx_mbps"] == 480.0                              # KB/s converted
    assert g["throttle_reasons"] == 4 and g["throttle"] == ["sw_power_cap"]
    assert g["ecc_corrected"] == 3 and g["ecc_uncorrected"] == 0
    assert g["nvlink_tx_mbps"] == pytest.approx(2_000_000 * 1024 / 1e6 / 2.0)
    assert g["nvlink_rx_mbps"] == pytest.approx(1_000_000 * 1024 / 1e6 / 2.0)
    assert g["process_mem_mb"] == {4242: 3 * 1024.0}  # only the watched PID
    assert g["uuid"] == "GPU-x" and g["name"].startswith("Fake")


def test_unsupported_metrics_become_none_not_errors():
    unsupported = {"nvmlDeviceGetFanSpeed", "nvmlDeviceGetTotalEccErrors",
                   "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
                   "nvmlDeviceGetPowerUsage", "nvmlDeviceGetComputeRunningProcesses",
                   "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetMaxClockInfo"}
    fake = FakeNVML([FakeGPU(unsupported=unsupported)])
    g = NVMLSampler(nvml=fake, visible=None).sample(pids=[1])[0]
    for k in ("fan_pct", "ecc_corrected", "ecc_uncorrected", "encoder_util", "decoder_util",
              "power_w", "process_mem_mb", "pcie_tx_mbps", "clock_sm_max_mhz",
              "nvlink_tx_mbps"):  # a PCIe board: no NVLink
        assert g[k] is None, k
    assert g["util_gpu"] == 85.0 and g["temperature_c"] == 61.0  # the rest still comes


def test_nvml_calls_per_sample_are_constant():
    fake = FakeNVML(2)
    s = NVMLSampler(nvml=fake, visible=None)
    s.sample()
    before = s.calls
    s.sample()
    per_sample = s.calls - before
    s.sample()
    assert s.calls - before == 2 * per_sample
    assert s.calls == fake.total_calls  # every call is counted


@pytest.mark.parametrize("kind", ["library", "driver"])
def test_nvml_unavailable_is_not_an_error(kind):
    s = NVMLSampler(nvml=FakeNVML(init_error=kind))
    assert s.sample() == []
    assert not s.available and s.reason.startswith("NVML unavailable:")


@pytest.mark.skipif(gpu_count() == 0, reason="no NVIDIA GPU/driver on this host: the real NVML path "
                    "cannot run; test_every_gpu_field_populated_and_typed covers it with FakeNVML")
def test_real_nvml_when_present():
    s = NVMLSampler()
    gpus = s.sample()
    assert len(gpus) == gpu_count()
    # what every NVIDIA datacenter and desktop board reports
    _check_types(gpus[0], {k: GPU_FIELDS[k] for k in (
        "util_gpu", "util_mem", "mem_used_mb", "mem_free_mb", "mem_total_mb", "mem_used_pct",
        "temperature_c", "power_w", "power_limit_w", "clock_sm_mhz", "clock_mem_mhz",
        "clock_sm_max_mhz", "pstate", "throttle_reasons", "throttle")})
    _check_types(gpus[0], GPU_FIELDS, allow_none=tuple(GPU_FIELDS))
    s.close()


# --- host sampler ------------------------------------------------------------------------------
def test_host_fields_populated_and_typed():
    h = HostSampler()
    h.sample()
    with open(__file__, "rb") as f:  # some disk activity between the two samples is fine
        f.read()
    s = h.sample()
    _check_types(s, HOST_FIELDS)
    assert len(s["cpu_per_core"]) == s["cpu_count"] >= 1
    assert 0.0 <= s["cpu_pct"] <= 100.0 and 0.0 < s["ram_pct"] < 100.0
    assert s["ram_used_mb"] < s["ram_total_mb"]
    assert h.calls > 0


def test_host_rates_from_counter_deltas():
    class FakeCounters:  # a psutil double with controllable counters
        def __init__(self):
            self.read = 0

        def cpu_times(self, percpu=False):
            from collections import namedtuple

            T = namedtuple("T", "user system idle")
            return [T(10.0 + self.read / 1e7, 0.0, 10.0), T(5.0, 0.0, 15.0)]

        def virtual_memory(self):
            from types import SimpleNamespace

            return SimpleNamespace(total=8 * 2**30, available=6 * 2**30, percent=25.0)

        def swap_memory(self):
            from types import SimpleNamespace

            return SimpleNamespace(used=0, percent=0.0)

        def disk_io_counters(self):
            from types import SimpleNamespace

            return SimpleNamespace(read_bytes=self.read, write_bytes=0)

        def net_io_counters(self):
            raise OSError("no network interfaces")  # -> None, not an exception

        def getloadavg(self):
            return (1.0, 0.5, 0.25)

    ps, clock = FakeCounters(), Clock()
    h = HostSampler(psutil=ps, clock=clock)
    first = h.sample()
    assert first["disk_read_mbps"] == 0.0 and first["net_recv_mbps"] is None
    ps.read, clock.t = 50_000_000, clock.t + 2.0
    s = h.sample()
    assert s["disk_read_mbps"] == pytest.approx(25.0)
    assert s["cpu_per_core"][1] == 0.0 and s["cpu_per_core"][0] == pytest.approx(100.0)
    assert s["cpu_pct"] == pytest.approx(50.0)
    assert s["ram_used_mb"] == 2 * 1024 and s["load_15"] == 0.25


# --- the shared sampler ------------------------------------------------------------------------
def test_interval_default_and_clamp():
    assert Sampler(gpu=NVMLSampler(nvml=FakeNVML())).interval == 1.0
    s = Sampler(interval=0.01, gpu=NVMLSampler(nvml=FakeNVML()))
    assert s.interval == 0.25
    s.interval = 0.5
    assert s.interval == 0.5
    for bad in (0, -1, "fast", None, True):
        with pytest.raises(ValueError, match="interval: got"):
            s.interval = bad


def test_history_is_bounded():
    s = Sampler(history_len=5, gpu=NVMLSampler(nvml=FakeNVML()))
    assert s.latest() is None and s.history() == []
    for _ in range(20):
        s.sample_once()
    h = s.history()
    assert len(h) == 5 and [x["seq"] for x in h] == list(range(15, 20))
    assert s.latest()["seq"] == 19 and [x["seq"] for x in s.history(2)] == [18, 19]
    assert s.history(0) == []


@pytest.mark.slow  # over half a second
def test_one_thread_for_everyone_and_constant_call_rate():
    fake = FakeNVML(2)
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=fake, visible=None))
    assert not s.running and s.stats["threads_started"] == 0  # lazy: no thread yet
    got: list[list] = [[] for _ in range(50)]
    fns = [got[i].append for i in range(50)]
    s.subscribe(fns[0])
    wait_for(lambda: len(got[0]) >= 3, what="3 samples")
    a = s.stats
    for fn in fns[1:]:
        s.subscribe(fn)
    wait_for(lambda: s.stats["samples"] >= a["samples"] + 4, what="4 more samples")
    b = s.stats
    wait_for(lambda: s.stats["samples"] >= b["samples"] + 3, what="3 more samples")
    c = s.stats
    per_sample_1 = (b["nvml_calls"] - a["nvml_calls"]) / (b["samples"] - a["samples"])
    per_sample_50 = (c["nvml_calls"] - b["nvml_calls"]) / (c["samples"] - b["samples"])
    assert per_sample_1 == per_sample_50 > 0  # 50 listeners cost NVML what one does
    assert (c["psutil_calls"] - b["psutil_calls"]) / (c["samples"] - b["samples"]) == \
        (b["psutil_calls"] - a["psutil_calls"]) / (b["samples"] - a["samples"])
    assert s.stats["threads_started"] == 1 and s.stats["subscribers"] == 50
    thread = s._thread
    assert thread.is_alive() and thread.name == "gpu_lab-telemetry"
    assert all(len(g) >= 3 for g in got[1:])
    assert got[7][-1]["gpus"][1]["index"] == 1  # the sample itself, shared, not copied per listener
    for fn in fns:
        s.unsubscribe(fn)
    wait_for(lambda: not thread.is_alive(), what="the sampler thread to end")
    assert not s.running
    n = s.stats["samples"]
    s.subscribe(fns[0])  # a new listener starts it again
    wait_for(lambda: s.stats["samples"] > n, what="a sample after restart")
    assert s.stats["threads_started"] == 2
    s.close()
    assert not s.running


def test_a_failing_subscriber_does_not_stop_the_others():
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML()))
    got = []

    def broken(sample):
        raise RuntimeError("a view bug")

    s.subscribe(broken)
    s.subscribe(got.append)
    wait_for(lambda: len(got) >= 2, what="samples despite a broken subscriber")
    assert s.stats["errors"] >= 1
    s.close()


@pytest.mark.slow  # over half a second
def test_host_only_mode_with_a_one_line_notice(caplog, monkeypatch):
    monkeypatch.setattr(sampler_mod, "_notice_logged", False)
    caplog.set_level(logging.WARNING, logger="gpu_lab.telemetry")
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(init_error="driver")))
    got = []
    s.subscribe(got.append)
    wait_for(lambda: len(got) >= 3, what="host-only samples")
    s.close()
    assert all(x["gpus"] == [] for x in got)
    _check_types(got[-1]["host"], HOST_FIELDS)
    assert s.stats["nvml"] is False and s.stats["errors"] == 0
    notices = [r for r in caplog.records if r.name == "gpu_lab.telemetry"]
    assert len(notices) == 1 and "\n" not in notices[0].getMessage()
    assert "host metrics only" in notices[0].getMessage() and "Driver Not Loaded" in s.notice
    s2 = Sampler(gpu=NVMLSampler(nvml=FakeNVML(init_error="library")))
    s2.sample_once()
    assert len([r for r in caplog.records if r.name == "gpu_lab.telemetry"]) == 1  # once


def test_watched_processes_report_their_gpu_memory():
    import os

    fake = FakeNVML([FakeGPU(processes={os.getpid(): 2 * 1024**3, 1: 1024**3})])
    s = Sampler(gpu=NVMLSampler(nvml=fake, visible=None))
    assert s.sample_once()["gpus"][0]["process_mem_mb"] == {}
    s.watch(os.getpid())
    assert s.sample_once()["gpus"][0]["process_mem_mb"] == {os.getpid(): 2048.0}
    s.unwatch(os.getpid())
    assert s.sample_once()["gpus"][0]["process_mem_mb"] == {}


def test_get_sampler_is_one_object():
    assert get_sampler() is get_sampler()
    assert isinstance(get_sampler(), Sampler)


def test_import_and_sampling_never_touch_torch():
    """The kernel must stay CUDA-free: telemetry uses NVML, never torch.cuda (nor torch at all)."""
    code = ("import sys, threading, gpu_lab.telemetry as t\n"
            "assert threading.active_count() == 1, 'a thread started at import'\n"
            "s = t.get_sampler(); s.sample_once(); got = []\n"
            "s.subscribe(got.append)\n"
            "import time; d = time.time() + 10\n"
            "while not got and time.time() < d: time.sleep(0.02)\n"
            "s.close(); assert got\n"
            "assert 'torch' not in sys.modules, 'telemetry imported torch'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
