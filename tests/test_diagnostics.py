"""gpu_lab.diagnostics on real processes and files: doctor (never touches CUDA), the advisor's dry
run against the profiler, the all-reduce benchmark on 2 gloo ranks, the I/O benchmark, the
bottleneck finder on a slow and a fast loader, triage texts with their numbers, the GPU benchmark's
CPU mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tarfile
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.diagnostics import doctor
from gpu_lab.diagnostics.doctor import SECTIONS
from gpu_lab.failures import explain
from gpu_lab.failures import triage
from gpu_lab.units import fmt_bytes

import diagnostics_fns as F

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 2**20, 2**30


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpu_lab.cli", *args], capture_output=True,
                          text=True, env=e, timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------------------------ doctor

def test_doctor_json_has_every_section_and_flags_cuda_launch_blocking():
    out = _cli("doctor", "--json", env={"CUDA_LAUNCH_BLOCKING": "1", "NVIDIA_TF32_OVERRIDE": "0",
                                        "NCCL_P2P_DISABLE": "1"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for section in SECTIONS:
        assert section in d, f"doctor --json lacks section {section!r}"
    for key in ("os", "python", "torch", "torch_cuda", "cuda_runtime", "cudnn", "nccl", "driver"):
        assert key in d["system"]
    assert d["system"]["torch"].startswith("2.")
    for key in ("cpu_model", "cpus_logical", "numa_nodes", "ram_total_bytes", "disks"):
        assert key in d["host"]
    assert d["host"]["numa_nodes"], "a Linux host has at least NUMA node 0"
    assert any(x["path"] == "/dev/shm" for x in d["host"]["disks"])
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE", "CUDA_LAUNCH_BLOCKING",
                "OMP_NUM_THREADS", "NCCL_DEBUG"):
        assert var in d["env"]
    assert d["env"]["CUDA_LAUNCH_BLOCKING"] == "1"
    assert d["fork_safety"]["safe"] is True
    assert {"count", "devices"} <= set(d["gpus"])
    assert {"matrix", "p2p", "legend"} <= set(d["topology"])
    topics = {w["topic"]: w for w in d["warnings"]}
    w = topics["CUDA_LAUNCH_BLOCKING"]
    assert w["level"] == "warning" and "debugging" in w["message"] and "Unset it" in w["message"]
    assert topics["NVIDIA_TF32_OVERRIDE"]["level"] == "warning"
    assert topics["NCCL_P2P_DISABLE"]["level"] == "warning"


def test_doctor_never_initialises_cuda_in_a_fresh_process():
    # A tripwire on every entry to CUDA torch has (the runtime device count poisons forks even
    # without a GPU): doctor must not touch any of them, even with torch already imported.
    code = r"""
import json, os, sys, time
import torch
hits = []
def trip(name, orig):
    def f(*a, **k):
        hits.append(name)
        return orig(*a, **k)
    return f
torch._C._cuda_getDeviceCount = trip("cudaGetDeviceCount", torch._C._cuda_getDeviceCount)
torch._C._cuda_init = trip("cuda_init", torch._C._cuda_init)
torch.cuda._lazy_init = trip("lazy_init", torch.cuda._lazy_init)
import gpu_lab
t0 = time.perf_counter()
rep = gpu_lab.doctor()
dt = time.perf_counter() - t0
pid = os.fork()
if pid == 0:
    os._exit(3 if torch._C._cuda_isInBadFork() else 0)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"hits": hits, "initialized": torch.cuda.is_initialized(), "child": child,
                  "elapsed": dt, "safe": rep.fork_safety["safe"], "html": "<table" in rep._repr_html_(),
                  "text": "Warnings" in str(rep)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["hits"] == [], f"doctor called into CUDA: {r['hits']}"
    assert r["initialized"] is False
    assert r["child"] == 0, "a process forked after doctor() is in CUDA's bad-fork state"
    assert r["safe"] and r["html"] and r["text"]
    print(f"doctor took {r['elapsed']:.2f} s")


def test_doctor_does_not_import_torch():
    code = "import sys, gpu_lab; gpu_lab.doctor(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_doctor_reports_an_unsafe_kernel():
    from gpu_lab.launch.testing import fake_cuda_state

    with fake_cuda_state(initialized=True):
        rep = doctor()
    assert rep.fork_safety["safe"] is False
    assert "already initialised" in rep.fork_safety["problem"]
    assert rep.warnings[0].topic == "fork safety"


def test_doctor_gpu_topology_through_nvml_double():
    # NVML needs a GPU; FakeTopologyNVML is a test double for it (the real path: any GPU host).
    nv = F.FakeTopologyNVML(gpus=4, nvlink_pairs={(0, 1): 4, (2, 3): 2}, numa=[0, 0, 1, 1])
    rep = doctor(nvml=nv, env={"NCCL_DEBUG": "INFO"})
    assert rep.gpus["count"] == 4
    g0 = rep.gpus["devices"][0]
    assert g0["name"] == "NVIDIA H100 80GB HBM3" and g0["compute_capability"] == "9.0"
    assert g0["memory_total_bytes"] == 80 * GiB and g0["numa_node"] == 0
    assert rep.system["driver"] == "575.51.03" and rep.system["driver_cuda"] == "12.9"
    m = rep.topology["matrix"]
    assert m[0] == ["X", "NV4", "SYS", "SYS"]
    assert m[2][3] == "NV2" and m[3][2] == "NV2"
    assert rep.topology["p2p"][0][1] is True and rep.topology["p2p"][0][2] is False
    assert "NV# = connected by # NVLinks" in rep.topology["legend_text"]
    assert rep.warnings_about("NCCL_DEBUG")[0].level == "info"
    assert "GPU0" in str(rep) and "NV4" in rep._repr_html_()
    assert nv.initialised is False, "doctor must shut NVML down again"


# a run's supervisor: claims a CPU slot in the host's queue, forks a "rank", says both pids
CLAIMANT = r"""
import subprocess, sys, time
from gpu_lab.supervise.claims import wait_for_devices
claim = wait_for_devices(1, "run-doctor", kind="cpu")
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(rank.pid, flush=True)
sys.stdin.read()
rank.kill()
"""


def test_doctor_names_gpu_memory_that_no_live_run_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(tmp_path / "claims"))
    env = {**os.environ, "GPU_LAB_CPU_SLOTS": "2", "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, "-c", CLAIMANT], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        rank = int(run.stdout.readline())
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        nv = F.FakeTopologyNVML(gpus=3)  # FakeNVML with what doctor asks besides
        nv.gpus[0].processes = {rank: 6 * GiB, run.pid: 300 * MiB}  # the run's: not named
        nv.gpus[1].processes = {stray.pid: 3 * GiB}
        nv.gpus[2].processes = {int(gone): 1 * GiB}  # ended: its pid is no one's now
        rep = doctor(nvml=nv)
        held = rep.gpus["unowned_processes"]
        assert [(p["gpu"], p["pid"]) for p in held] == [(1, stray.pid), (2, int(gone))]
        assert held[0]["bytes"] == 3 * GiB and "time.sleep(600)" in held[0]["command"]
        assert held[0]["user"] and "not visible" in held[1]["command"]
        (w,) = rep.warnings_about("GPU memory")
        assert w.level == "warning"
        for needle in (f"GPU 1: pid {stray.pid}", "3.00 GiB", "kill <pid>", held[0]["user"]):
            assert needle in w.message, (needle, w.message)
        assert str(rank) not in w.message
        # the run ends: its rank, still holding memory, is named too
        run.stdin.close()
        run.wait(30)
        nv.gpus[0].processes = {stray.pid: 1 * GiB}
        assert [p["pid"] for p in doctor(nvml=nv).gpus["unowned_processes"]] == [stray.pid,
                                                                                  stray.pid, int(gone)]
    finally:
        stray.kill()
        run.kill()
        stray.wait(), run.wait()


# ----------------------------------------------------------------------------------- advisor

def test_advisor_estimate_for_resnet50_is_within_25_percent_of_the_profiled_peak():
    from gpu_lab.diagnostics import estimate_memory, measure_memory

    # ResNet-50, batch 32, fp32, AdamW; 64 px keeps the real run (profiled, 2 steps) to seconds
    # on 2 CPU cores (at 224 px both sides agree too: 2.88 GiB estimated, 2.89 GiB profiled)
    est = estimate_memory("resnet50", image_size=64, batch_size=32, precision="fp32",
                          optimizer="adamw")
    assert est.parameters_bytes == pytest.approx(25_557_032 * 4 + 0.2 * MiB, rel=0.01)
    assert est.gradients_bytes == pytest.approx(25_557_032 * 4, rel=1e-6)
    assert est.optimizer_bytes == pytest.approx(2 * 25_557_032 * 4, rel=0.01)  # AdamW: 2 moments
    assert est.activations_bytes > 0
    real = measure_memory("resnet50", image_size=64, batch_size=32, precision="fp32",
                          optimizer="adamw", steps=2)
    assert real["device"] == "cpu" and real["peak_bytes"]
    ratio = est.peak_bytes / real["peak_bytes"]
    print(f"estimate {est.peak_bytes / MiB:.1f} MiB, profiler {real['peak_bytes'] / MiB:.1f} MiB, "
          f"ratio {ratio:.3f}")
    assert 0.75 <= ratio <= 1.25


def test_dry_run_keeps_the_process_fork_safe_and_bf16_and_checkpointing_shrink_activations():
    import torch  # noqa: F401 - loaded, as a kernel that trains has it

    from gpu_lab.diagnostics import estimate_memory

    base = estimate_memory("tiny_resnet", 64, 64, "fp32", num_classes=4)
    bf16 = estimate_memory("tiny_resnet", 64, 64, "bf16", num_classes=4)
    ac = estimate_memory("tiny_resnet", 64, 64, "fp32", num_classes=4,
                         activation_checkpointing=True)
    assert bf16.activations_bytes < 0.75 * base.activations_bytes
    assert ac.activations_bytes < base.activations_bytes
    assert base.optimizer_bytes == pytest.approx(2 * base.gradients_bytes, rel=0.01)
    # in a fresh interpreter: this test process may have asked torch for CUDA in another test
    probe = textwrap.dedent("""
        import os, sys, torch
        from gpu_lab.diagnostics import estimate_memory
        estimate_memory("tiny_resnet", 64, 64, "bf16", num_classes=4)
        pid = os.fork()
        if pid == 0:  # a forked worker must still be able to use CUDA and autograd
            if torch._C._cuda_isInBadFork():
                os._exit(3)
            try:
                x = torch.ones(2, requires_grad=True)
                (x * 2).sum().backward()
            except RuntimeError:
                os._exit(4)
            os._exit(0)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        sys.exit(code if code else (5 if torch.cuda.is_initialized() else 0))
    """)
    code = subprocess.run([sys.executable, "-c", probe], timeout=300).returncode
    assert code != 3, "the dry run poisoned forks (FakeTensorMode / AdamW asked CUDA for devices)"
    assert code != 4, "after the dry run, forked children cannot run backward (autograd threads)"
    assert code != 5, "the dry run initialised CUDA"
    assert code == 0
    from gpu_lab.diagnostics.isolate import in_child

    with pytest.raises(ValueError, match="invalid literal"):
        in_child(int, "not a number")  # the child's exception comes back as itself


def test_advice_lists_fits_counts_and_remedies_in_order():
    from gpu_lab.diagnostics.advisor import MemoryEstimate, advise

    # ResNet-50 at 224 px, batch 256, fp32: the dry run's numbers (2.9 GiB at batch 32, ×8)
    est = MemoryEstimate("resnet50", 224, 256, "fp32", "adamw", 1000, False,
                         parameters_bytes=102_500_000, gradients_bytes=102_228_128,
                         optimizer_bytes=204_456_256, activations_bytes=22_040_000_000,
                         inputs_bytes=154_140_672, peak_bytes=22_500_000_000)
    adv = advise("resnet50", 224, 256, target="P100 16GB", estimate=est, measure_switches=False)
    fits = {f.gpu: f for f in adv.fits}
    assert not fits["P100 16GB"].fits_one and fits["P100 16GB"].min_gpus == 2
    assert fits["P100 16GB"].per_gpu_batch == 128
    assert fits["A100 80GB"].fits_one and fits["A100 80GB"].min_gpus == 1
    assert fits["V100 32GB"].article_pick == "usual pick: 4× V100 32GB"
    assert adv.remedies, "it does not fit one P100: there must be something to switch on"
    peaks = [r.peak_bytes for r in adv.remedies]
    assert peaks == sorted(peaks) and all(p < est.peak_bytes for p in peaks)
    assert any(r.switch.startswith("batch_size=128") for r in adv.remedies)
    text = str(adv)
    assert "P100 16GB" in text and "what to switch on" in text
    assert "<table>" in adv._repr_html_()
    with pytest.raises(ValueError, match="precision: got 'fp8'; accepted: 'fp32', 'tf32'"):
        advise("resnet50", precision="fp8")


# ----------------------------------------------------------------------- all-reduce benchmark

def test_allreduce_benchmark_prints_busbw_for_two_gloo_ranks():
    out = _cli("bench", "allreduce", "--sizes", "8:64K", "-n", "2", "--iters", "5", "--warmup", "1")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "busbw(GB/s)" in out.stdout and "algbw(GB/s)" in out.stdout
    assert "2 ranks, gloo on cpu" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines()
            if line.strip() and line.strip().split()[0].isdigit() and len(line.split()) == 7]
    assert [int(r[0]) for r in rows] == [8 * 2**i for i in range(14)]  # 8 B .. 64 KiB
    assert all(float(r[5]) >= 0 and r[6] == "0" for r in rows)     # busbw, #wrong
    assert float(rows[-1][5]) > 0
    assert "# Out of bounds values : 0 OK" in out.stdout
    assert "# Avg bus bandwidth" in out.stdout


def test_allreduce_result_math():
    from gpu_lab.diagnostics import allreduce_bench, parse_sizes

    assert parse_sizes("8:256M")[0] == 8 and parse_sizes("8:256M")[-1] == 256 * MiB
    assert len(parse_sizes("8:256M")) == 26
    assert parse_sizes(["1K", 4096]) == [1024, 4096]
    with pytest.raises(ValueError, match="accepted: 'MIN:MAX'"):
        parse_sizes("8-256M")
    res = allreduce_bench([1024, 4 * MiB], num_processes=2, iters=3, warmup=1)
    assert res.world_size == 2 and res.backend == "gloo" and res.wrong == 0
    for r in res.rows:  # nccl-tests: busbw = algbw × 2(n−1)/n
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * (2 - 1) / 2)
        assert r.algbw_gbps == pytest.approx(r.size_bytes / (r.time_us * 1e-6) / 1e9, rel=1e-6)
    assert "4 MiB" in res.bars()


# ------------------------------------------------------------------------------ I/O benchmark

def test_io_bench_reads_a_directory_and_removes_its_test_file(tmp_path):
    from gpu_lab.diagnostics import io_bench

    res = io_bench(tmp_path, write_test_mb=8, rand_reads=200)
    assert res.files == 1 and res.bytes_total == 8 * MiB and res.seq_bytes == 8 * MiB
    assert res.seq_mb_s > 0 and res.rand_iops > 0 and res.rand_reads == 200
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a").write_bytes(os.urandom(3 * MiB))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(os.urandom(MiB))
    res = io_bench(tmp_path, rand_reads=50)
    assert res.files == 2 and res.bytes_total == 4 * MiB
    assert "sequential read" in str(res)
    out = _cli("bench", "io", str(tmp_path), "--json", "--rand-reads", "20")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"] == 2
    with pytest.raises(ValueError, match="write_test_mb=256"):
        io_bench(_empty(tmp_path))


def _empty(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_disk_monitor_rates_from_counters():
    from types import SimpleNamespace

    from gpu_lab.diagnostics import DiskMonitor

    # a scripted counter source (the real one is psutil's /proc/diskstats, used by default)
    ticks = iter([
        {"sda": SimpleNamespace(read_bytes=0, write_bytes=0, read_count=0, write_count=0, busy_time=0),
         "sda1": SimpleNamespace(read_bytes=0, write_bytes=0, read_count=0, write_count=0, busy_time=0)},
        {"sda": SimpleNamespace(read_bytes=50_000_000, write_bytes=10_000_000, read_count=400,
                                write_count=100, busy_time=500),
         "sda1": SimpleNamespace(read_bytes=1, write_bytes=1, read_count=1, write_count=1, busy_time=1)},
    ])
    clock = iter([100.0, 101.0])
    import gpu_lab.diagnostics.iobench as io

    mon = DiskMonitor(counters=lambda: next(ticks))
    orig = io.time.monotonic
    io.time.monotonic = lambda: next(clock)
    try:
        assert mon.sample() == []
        (s,) = mon.sample()
    finally:
        io.time.monotonic = orig
    assert s.disk == "sda" and s.read_mb_s == pytest.approx(50.0) and s.write_mb_s == pytest.approx(10.0)
    assert s.reads_per_s == pytest.approx(400) and s.util_pct == pytest.approx(50.0)
    assert "%util" in DiskMonitor.format([s])


def test_disk_monitor_runs_on_the_real_disks(tmp_path):
    from gpu_lab.diagnostics import DiskMonitor
    from proc_utils import wait_until

    got = []
    with DiskMonitor(interval=0.1, on_sample=got.append) as mon:
        f = tmp_path / "w"
        f.write_bytes(os.urandom(4 * MiB))
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        wait_until(lambda: len(got) >= 2, 10, what="two disk samples")
    assert mon.samples and all(s.read_mb_s >= 0 and s.write_mb_s >= 0 for s in mon.samples)


# ------------------------------------------------------------------------- bottleneck finder

def test_bottleneck_finder_names_data_for_a_slow_loader_and_compute_without_one():
    from gpu_lab.diagnostics import find_bottleneck
    from gpu_lab.diagnostics.bottleneck import Fix

    slow = gpu_lab.launch(F.train_timed, 10, 0.006, num_processes=2, name="slow-loader")
    fast = None
    try:
        assert slow.wait(180) == "succeeded", slow.logs(0)
        # more steps: on a loaded machine a few preempted data waits must not weigh as much as
        # a slow loader (a 10-step run measured 28% data beside another test worker)
        fast = gpu_lab.launch(F.train_timed, 40, 0.0, num_processes=2, name="fast-loader")
        assert fast.wait(180) == "succeeded", fast.logs(0)
    finally:
        for r in (slow, fast):
            if r is not None and not r.done:
                r.stop()
    b_slow = find_bottleneck(slow)
    b_fast = find_bottleneck(fast)
    print(b_slow, b_fast, sep="\n")
    assert b_slow.bound == "data", str(b_slow)
    assert b_fast.bound == "compute", str(b_fast)
    assert b_slow.fractions()["data"] > b_fast.fractions()["data"]
    assert b_slow.fwd_bwd is not None and b_slow.optimizer is not None
    assert "num_workers" in b_slow.recommendations[0]
    assert "bf16" in b_fast.recommendations[0]
    # the registry holds the same metrics: the finder reads a finished run by id too
    assert find_bottleneck(slow.id).bound == "data"
    wf = b_slow.waterfall([Fix("shards", "data", 0.7), Fix("bf16", "compute", 0.35)])
    assert [w.label for w in wf] == ["your run", "shards", "bf16"]
    assert wf[1].samples_per_s > wf[0].samples_per_s


def test_waterfall_applies_each_fix_to_its_part():
    from gpu_lab.diagnostics.bottleneck import Fix, compare, make_breakdown

    b = make_breakdown(0.1, 0.05, comm=0.02, samples_per_s=320)
    assert b.bound == "data" and b.compute == pytest.approx(0.03)
    wf = b.waterfall([Fix("x", "communication", 0.5)])
    assert wf[-1].step_time == pytest.approx(0.09) and wf[-1].samples_per_s == pytest.approx(32 / 0.09)
    assert make_breakdown(0.1, 0.0, comm=0.04, samples_per_s=320).bound == "communication"
    after = make_breakdown(0.05, 0.005, samples_per_s=640)
    steps = compare(b, after, "fixed")
    assert steps[0].samples_per_s == pytest.approx(320) and steps[-1].samples_per_s == pytest.approx(640)
    with pytest.raises(ValueError, match="step_time: got 0"):
        make_breakdown(0, 0)


def test_breakdown_from_a_profiler_trace(tmp_path):
    from gpu_lab.diagnostics import breakdown_from_trace
    from gpu_lab.diagnostics.isolate import in_child

    # the profiler asks the CUDA runtime for devices: profile in a throwaway child, so that this
    # process (which launches runs in other tests) stays fork-safe on a GPU host too
    trace = in_child(F.profile_slow_loop, str(tmp_path / "t.json"), timeout=120)
    b = breakdown_from_trace(trace)
    assert b.steps >= 3 and b.bound == "data", str(b)
    assert b.optimizer and b.optimizer > 0 and b.data >= 0.01  # 8 × 3 ms of latency per batch
    assert b.source == "profiler trace t.json"


# ------------------------------------------------------------------------------------- triage

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
            "of which 1.25 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB "
            "memory in use. Of the allocated memory 74.10 GiB is allocated by PyTorch, and 2.30 GiB "
            "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_triage_of_a_simulated_cuda_oom_carries_the_numbers():
    import torch

    explain.note(batch_size=256, grad_accum_steps=1, num_processes=8, mixed_precision="no")
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_OOM)
        except torch.OutOfMemoryError as e:
            f = triage.from_exception(3, e)
    finally:
        explain.note(batch_size=None, grad_accum_steps=None, num_processes=None, mixed_precision=None)
    assert f.category == triage.OOM
    d = f.details
    assert d["requested_bytes"] == 2 * GiB and d["free_bytes"] == int(1.25 * GiB)
    assert d["total_bytes"] == round(79.15 * GiB) and d["device"] == "GPU 0"
    assert d["batch_size"] == 256 and d["reserved_unallocated_bytes"] == round(2.30 * GiB)
    assert f.explanation.startswith("Out of memory on GPU 0: tried to allocate 2.00 GiB with 1.25 GiB "
                                    "free of 79.15 GiB, batch size 256.")
    assert "The request is 768.00 MiB more than what was free" in f.explanation
    # cheapest first: the allocator setting, then the same global batch in halves, ...
    assert f.suggestions[0].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert f.suggestions[1].startswith("batch_size=128 (from 256) with grad_accum_steps=2: the same "
                                       "global batch of 2048")
    assert any("bf16" in s for s in f.suggestions) and any("zero=True" in s for s in f.suggestions)
    assert any("more than 79.90 GiB" in s and "H200 141GB" in s for s in f.suggestions)
    text = str(triage.RunError([f]))
    assert "2.00 GiB" in text and "1.25 GiB free of 79.15 GiB" in text and "batch size 256" in text
    # the same text from numbers alone
    rep = gpu_lab.diagnostics.oom_report(2 * GiB, int(1.25 * GiB), round(79.15 * GiB), 64)
    assert "tried to allocate 2.00 GiB with 1.25 GiB free of 79.15 GiB, batch size 64" in rep
    assert "1. batch_size=32 (from 64)" in rep


def test_triage_finds_the_batch_size_in_the_failing_frame():
    import torch

    def step(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    try:
        step(torch.zeros(48, 3, 2, 2))
    except torch.OutOfMemoryError as e:
        f = triage.from_exception(0, e)
    assert f.details["batch_size"] == 48 and "x.shape[0] in step()" in f.details["batch_size_source"]
    assert f.details["requested_bytes"] == 20 * MiB


def test_real_cpu_oom_under_an_allocation_cap_is_triaged_with_its_numbers():
    from gpu_lab.diagnostics import estimate_memory

    cap = 256 * MiB
    big, small = 512, 16
    # the advisor predicts it: batch 512 needs more than the cap, batch 16 far less
    assert estimate_memory("tiny_resnet", 64, big, num_classes=4).peak_bytes > cap
    assert estimate_memory("tiny_resnet", 64, small, num_classes=4).peak_bytes < cap / 4
    run = gpu_lab.launch(F.train_capped, big, cap, num_processes=2, name="oom-capped")
    assert run.wait(180) == "failed"
    err = run.error
    f = err.first
    assert f.category == triage.OOM, str(err)
    d = f.details
    assert d["device"] == "CPU" and d["memory_cap"] is True and d["total_bytes"] == cap
    assert d["batch_size"] == big and d["free_bytes"] < cap
    text = str(err)
    # torch's allocator says what it asked for; oneDNN, which meets the cap first on some runs
    # (tests/test_oom_triage.py), does not
    if "DefaultCPUAllocator" in f.message:
        assert 0 < d["requested_bytes"] and d["free_bytes"] < d["requested_bytes"]
        assert f"tried to allocate {fmt_bytes(d['requested_bytes'])}" in text
    assert "free of 256.00 MiB" in text and f"batch size {big}" in text
    assert "batch_size=256 (from 512) with grad_accum_steps=2" in text
    fixed = gpu_lab.launch(F.train_capped, small, cap, num_processes=2, name="oom-fixed")
    assert fixed.wait(180) == "succeeded", str(fixed.error)


def test_real_collective_timeout_names_the_collective_and_its_timeout():
    run = gpu_lab.launch(F.collective_timeout, 2.0, num_processes=2, name="timeout")
    assert run.wait(180) == "failed"
    f = run.error.first
    assert f.rank == 0 and f.category == triage.COMM, str(run.error)
    assert f.details["collective"] == "all_reduce" and f.details["timeout_s"] == 2.0
    assert f.details["backend"] == "gloo"
    assert "waited in all_reduce (gloo) and gave up at its timeout of 2 s" in f.explanation
    assert any("timedelta(seconds=60)" in s for s in f.suggestions)
    assert "all_reduce" in str(run.error)
    # NCCL's watchdog message carries the op, the element count and the timeout
    d = explain.parse_comm("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                          "OpType=ALLREDUCE, NumelIn=25557032, NumelOut=25557032, Timeout(ms)=600000) "
                          "ran for 600015 milliseconds before timing out.")
    assert d == {"backend": "nccl", "seq": 7, "collective": "allreduce", "numel": 25557032,
                 "timeout_s": 600.0, "elapsed_s": 600.015}
    text = gpu_lab.diagnostics.comm_report(d["collective"], d["timeout_s"], elapsed_s=d["elapsed_s"],
                                           numel=d["numel"], backend="nccl", rank=1)
    assert "rank 1 waited in allreduce of 25,557,032 elements (nccl) after 600.015 s" in text


def test_real_truncated_shard_is_triaged_with_its_path(tmp_path):
    from gpu_lab.data import make_synthetic_images, shard_loader, write_shards

    make_synthetic_images(tmp_path / "img", 24, image_size=16, num_classes=2, seed=0)
    write_shards(tmp_path / "img", tmp_path / "s", maxcount=8, progress=False)
    victim = sorted((tmp_path / "s").glob("*.tar"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2 + 700])
    loader = shard_loader(tmp_path / "s", 4, train=False, image_size=16, num_workers=0,
                          rank=0, world_size=1)
    with pytest.raises(Exception) as info:
        for _ in loader:
            pass
    f = triage.from_exception(0, info.value)
    assert f.category == triage.DATA
    assert f.details["shard"] == str(victim)
    assert f.explanation.startswith(f"Data error in shard {victim}")
    assert str(victim) in f.suggestions[0] and "verify_shards" in f.suggestions[0]
    assert tarfile.is_tarfile(sorted((tmp_path / "s").glob("*.tar"))[0])
    rep = gpu_lab.diagnostics.data_report("/d/shard-000003.tar", sample="000042", samples_read=3,
                                          samples_lost=9)
    assert "Data error in shard /d/shard-000003.tar, sample '000042', after 3 good samples (9 lost)" in rep


# ------------------------------------------------------------------------------ GPU benchmark

def test_gpu_benchmark_cpu_mode_runs_and_prints_nvidia_reference():
    env = {"GPU_LAB_QUICK": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--cpu", "--steps", "1",
                          "--warmup", "0", "--json"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["device"] == "cpu" and [r["variant"] for r in d["rows"]] == ["fp32", "bf16"]
    assert all(r["images_per_s"] > 0 and r["channels_last"] for r in d["rows"])
    assert d["flops_per_image"] > 0
    from gpu_lab.diagnostics.gpubench import GPUBenchResult, BenchRow, training_flops

    # the GPU table, as printed on a GPU host (numbers made up; the layout and references are real)
    res = GPUBenchResult("cuda", "NVIDIA A100-SXM4-80GB", "resnet50", 224, 256, 30,
                         training_flops("resnet50", 224), {"tf32": 156.0, "bf16": 312.0},
                         [BenchRow("tf32", "tf32", True, False, 900.0, 284.4, 0.14, None, None, 938.0),
                          BenchRow("bf16", "bf16", True, False, 2400.0, 106.7, 0.19, None, None, 2470.0)])
    table = res.table()
    assert "938" in table and "2,470" in table and "0.96" in table
    assert res.flops_per_image == pytest.approx(24.3e9, rel=0.01)
