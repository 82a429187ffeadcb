"""bench/loader.py and its method (bench.lib.loader_method): the chain of back-to-back pairs, the
hypervisor's steal, the same-core estimate and the targets, on top of gpu_lab's loader benchmark.
Tiny sizes: this checks the plumbing; the script itself measures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import loader_method
from bench.lib.loader_method import LoaderMethodReport

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]


def test_bench_loader_script_reports_every_measurement(tmp_path):
    """`python bench/loader.py`, as a user runs it from the repository root: gpu-lab bench loader's
    flags, and --pairs / --same-core."""
    out = subprocess.run([sys.executable, "bench/loader.py", "--n", "96", "--image-size", "40",
                          "--crop-size", "32", "--workers", "2", "--batch-size", "16", "--steps", "3",
                          "--pairs", "2", "--same-core", "1", "--work-dir", str(tmp_path), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert set(d["rates"]) == {"naive_warm", "per_file_warm", "shards_warm", "per_file_cold",
                               "shards_cold", "shards_f32_warm", "limit"}
    assert all(v > 0 for v in d["rates"].values()) and all(v > 0 for v in d["cpu_rates"].values())
    assert set(d["cpu_ratios"]) == {"shards_vs_naive", "shards_vs_limit", "shards_vs_per_file_warm",
                                    "shards_vs_per_file_cold"}
    # the loader / limit ratio is the median of the back-to-back pairs, not of the best-of figures
    assert len(d["limit_pairs"]) == 2 and d["parallel_limit"] > 0
    assert min(d["limit_pairs"]) <= d["ratios"]["shards_vs_limit"] <= max(d["limit_pairs"])
    # in a chain limit, loader, limit, loader, limit: each loader pass against the limit passes
    # either side (the middle one serves both pairs), times the workers
    assert len(d["limit_chain"]) == 3 and len(d["loader_chain"]) == 2
    for i, pair in enumerate(d["limit_pairs"]):
        limits = d["limit_chain"][i:i + 2]
        assert pair == pytest.approx(d["loader_chain"][i] / (sum(limits) / 2 * 2))
    # the hypervisor's steal is measured for each pair and for the run (Linux reports it)
    assert len(d["pair_steal"]) == 2 and all(0.0 <= x <= 1.0 for x in d["pair_steal"])
    assert 0.0 <= d["steal"] <= 1.0
    # the workers' share of time on a CPU in each pair's loader pass; the same-core passes need a
    # core per worker and one more (2 workers: 3 cores), or the report says why there are none
    assert len(d["worker_busy"]) == 2 and all(0.0 < x <= 1.01 for x in d["worker_busy"])
    if (os.cpu_count() or 1) >= 3 and len(os.sched_getaffinity(0)) >= 3:
        assert len(d["same_core"]) == 1 and "shards_vs_limit_same_core" in d["ratios"]
    else:
        assert d["same_core"] == [] and "need 3 cores" in d["same_core_note"]
    # JPEG payloads are already entropy-coded: nowhere near the article's 3:1
    assert 0.5 < d["image_zstd_ratio"] < 2.0 and d["zstd_ratio"] > 1.0
    assert json.loads((tmp_path / "last_report.json").read_text())["limit_pairs"] == d["limit_pairs"]
    assert not list(tmp_path.glob("shards-*")), "temporary shards must be removed"
    # the table names every figure and checks the targets
    table = LoaderMethodReport.from_dict(d).table()
    for text in ("naive per-file PIL (warm)", "gpu_lab shard_loader (cold)", "pipeline limit",
                 "median of 2 back-to-back pairs", "each pair (ratio, CPU time stolen)",
                 "of the CPU time stolen by the hypervisor", "shards_vs_naive", "(>= 2:",
                 "data-wait fraction", "zstd: shard files", "zstd on the JPEG payloads alone"):
        assert text in table


def test_loader_vs_limit_is_the_median_of_the_quiet_pairs():
    """Pairs during which the hypervisor stole more than 1% of the CPU time are left out of the
    median, when at least three quiet ones and at least half of the pairs remain; the table shows
    both medians and every pair."""
    pairs, steal = [0.80, 0.95, 0.92, 0.60, 0.97], [0.0, 0.002, 0.01, 0.05, 0.0]
    report = LoaderMethodReport(n_images=10, source_size=8, crop_size=8, num_workers=1, batch_size=2,
                         augment="basic", rates={"shards_warm": 1.0, "limit": 1.0},
                         limit_pairs=pairs, pair_steal=steal)
    assert report.quiet_pairs() == [0.80, 0.95, 0.92, 0.97]
    assert report.ratios["shards_vs_limit"] == pytest.approx(0.935)
    table = report.table()
    assert "the 4 quiet ones of 5 back-to-back pairs" in table and "median of all: 0.92x" in table
    assert "0.60/5.0%" in table
    # fewer than three quiet pairs: every pair counts
    noisy = LoaderMethodReport.from_dict({**report.to_dict(), "pair_steal": [0.0, 0.03, 0.02, 0.05, 0.0]})
    assert noisy.quiet_pairs() == pairs and noisy.ratios["shards_vs_limit"] == pytest.approx(0.92)
    assert "median of 5 back-to-back pairs" in noisy.table()
    # three quiet pairs of seven: fewer than half, every pair counts
    seven = LoaderMethodReport.from_dict({**report.to_dict(), "limit_pairs": pairs + [0.70, 0.75],
                                   "pair_steal": [0.0, 0.03, 0.0, 0.05, 0.0, 0.02, 0.02]})
    assert seven.quiet_pairs() == pairs + [0.70, 0.75]
    assert seven.ratios["shards_vs_limit"] == pytest.approx(0.80)
    # four of seven: the quiet ones
    four = LoaderMethodReport.from_dict({**seven.to_dict(), "pair_steal": [0.0] * 4 + [0.02] * 3})
    assert four.quiet_pairs() == [0.80, 0.95, 0.92, 0.60]


def test_same_core_estimate_is_the_passes_median_times_the_workers_time_on_a_cpu():
    report = LoaderMethodReport(n_images=10, source_size=8, crop_size=8, num_workers=1, batch_size=2,
                         augment="basic", rates={"shards_warm": 1.0, "limit": 1.0},
                         limit_pairs=[0.85], pair_steal=[0.0], same_core=[0.97, 0.95, 0.99],
                         worker_busy=[0.99, 0.995, 0.98])
    assert report.ratios["shards_vs_limit_same_core"] == pytest.approx(0.97 * 0.99)
    table = report.table()
    assert "shards_vs_limit_same_core    0.96x " in table  # a reading, not judged
    assert "median of 3 passes: 0.970 (0.970 0.950 0.990)" in table and "99.0%" in table
    none = LoaderMethodReport.from_dict({**report.to_dict(), "same_core": [],
                                  "same_core_note": "1 worker(s) need 2 cores"})
    assert "shards_vs_limit_same_core" not in none.ratios
    assert "not measured: 1 worker(s) need 2 cores" in none.table()


def test_steal_seconds_is_read_from_proc_stat():
    first = loader_method.steal_seconds()
    assert first is not None and first >= 0.0
    assert loader_method.steal_seconds() >= first  # a counter since boot


def test_zstd_payload_ratio_compresses_each_payload_alone():
    text = [b"the same words again and again " * 40] * 3
    noise = [os.urandom(2000) for _ in range(3)]
    assert loader_method.zstd_payload_ratio(text) > 10
    assert 0.9 < loader_method.zstd_payload_ratio(noise) <= 1.0  # nothing left to squeeze
