"""The loader benchmark end to end (tiny sizes: this checks the plumbing, bench/loader.py measures),
and the page-cache eviction that its cold runs rely on."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_lab.cli import main
from gpu_lab.data import bench
from gpu_lab.data.bench import BenchReport
from gpu_lab.data.pagecache import evict, resident_fraction


def test_bench_loader_cli_reports_every_measurement(tmp_path, capsys):
    rc = main(["bench", "loader", "--n", "96", "--image-size", "40", "--crop-size", "32",
               "--workers", "2", "--batch-size", "16", "--steps", "3", "--repeats", "2", "--pairs", "2",
               "--same-core", "1", "--work-dir", str(tmp_path),
               "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["rates"]) == {"naive_warm", "per_file_warm", "shards_warm", "per_file_cold",
                               "shards_cold", "shards_f32_warm", "limit"}
    assert all(v > 0 for v in d["rates"].values())
    assert all(v > 0 for v in d["cpu_rates"].values()) and d["naive_limit_one_core"] > 0
    assert set(d["cpu_ratios"]) == {"shards_vs_naive", "shards_vs_limit", "shards_vs_per_file_warm",
                                    "shards_vs_per_file_cold"}
    assert set(d["ratios"]) == set(d["cpu_ratios"]) | {"shards_vs_parallel_limit"}
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
    # the workers' share of time on a CPU in each pair's loader pass; the same-core passes need a
    # core per worker and one more (2 workers: 3 cores), or the report says why there are none
    assert len(d["worker_busy"]) == 2 and all(0.0 < x <= 1.01 for x in d["worker_busy"])
    if (os.cpu_count() or 1) >= 3 and len(os.sched_getaffinity(0)) >= 3:
        assert len(d["same_core"]) == 1 and "shards_vs_limit_same_core" in d["ratios"]
    else:
        assert d["same_core"] == [] and "need 3 cores" in d["same_core_note"]
    assert 0.0 <= d["steal"] <= 1.0
    assert 0.0 <= d["data_wait"]["shards"] <= 1.0 and 0.0 <= d["data_wait"]["naive"] <= 1.0
    assert d["n_images"] == 96 and d["num_shards"] >= 1 and d["writer_images_per_minute"] > 0
    assert 0.5 < d["image_zstd_ratio"] < 2.0
    assert (tmp_path / "last_report.json").exists()
    assert not list(tmp_path.glob("shards-*")), "temporary shards must be removed"
    # the table names every figure and checks the targets
    report = BenchReport.from_dict(d)
    table = report.table()
    for text in ("naive per-file PIL (warm)", "gpu_lab shard_loader (cold)", "pipeline limit",
                 "shard_loader, normalised on CPU (warm)",
                 "naive path on one core", "img/CPU-s", "pipeline in 2 processes at once",
                 "median of 2 back-to-back pairs",
                 "shards_vs_naive", "(>= 2:", "data-wait fraction", "zstd: shard files"):
        assert text in table


def test_throughput_clock_stops_at_the_last_batch(monkeypatch):
    """A loader's rate runs from the first batch to the last: neither its start-up nor the time it
    takes to end after the last batch (a DataLoader joins its workers there) counts."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def loader():
        clock[0] += 50.0  # start-up, before the first batch
        for _ in range(5):
            yield (None, [0] * 10)  # (images, labels): 10 images a batch, one second apart
            clock[0] += 1.0
        clock[0] += 100.0  # shutdown, after the last batch

    p = bench.throughput(loader())
    assert p.images == 50
    assert p.rate == pytest.approx(40 / 4.0)  # the 4 batches after the first, over 4 seconds


def test_loader_vs_limit_is_the_median_of_the_quiet_pairs():
    """Pairs during which the hypervisor stole more than 1% of the CPU time are left out of the
    median, when at least three quiet ones and at least half of the pairs remain; the table shows
    both medians and every pair."""
    pairs, steal = [0.80, 0.95, 0.92, 0.60, 0.97], [0.0, 0.002, 0.01, 0.05, 0.0]
    report = BenchReport(n_images=10, source_size=8, crop_size=8, num_workers=1, batch_size=2,
                         augment="basic", rates={"shards_warm": 1.0, "limit": 1.0},
                         limit_pairs=pairs, pair_steal=steal)
    assert report.quiet_pairs() == [0.80, 0.95, 0.92, 0.97]
    assert report.ratios["shards_vs_limit"] == pytest.approx(0.935)
    table = report.table()
    assert "the 4 quiet ones of 5 back-to-back pairs" in table and "median of all: 0.92x" in table
    assert "0.60/5.0%" in table
    # fewer than three quiet pairs: every pair counts
    noisy = BenchReport.from_dict({**report.to_dict(), "pair_steal": [0.0, 0.03, 0.02, 0.05, 0.0]})
    assert noisy.quiet_pairs() == pairs and noisy.ratios["shards_vs_limit"] == pytest.approx(0.92)
    assert "median of 5 back-to-back pairs" in noisy.table()
    # three quiet pairs of seven: fewer than half, every pair counts
    seven = BenchReport.from_dict({**report.to_dict(), "limit_pairs": pairs + [0.70, 0.75],
                                   "pair_steal": [0.0, 0.03, 0.0, 0.05, 0.0, 0.02, 0.02]})
    assert seven.quiet_pairs() == pairs + [0.70, 0.75]
    assert seven.ratios["shards_vs_limit"] == pytest.approx(0.80)
    # four of seven: the quiet ones
    four = BenchReport.from_dict({**seven.to_dict(), "pair_steal": [0.0] * 4 + [0.02] * 3})
    assert four.quiet_pairs() == [0.80, 0.95, 0.92, 0.60]


def test_same_core_estimate_is_the_passes_median_times_the_workers_time_on_a_cpu():
    report = BenchReport(n_images=10, source_size=8, crop_size=8, num_workers=1, batch_size=2,
                         augment="basic", rates={"shards_warm": 1.0, "limit": 1.0},
                         limit_pairs=[0.85], pair_steal=[0.0], same_core=[0.97, 0.95, 0.99],
                         worker_busy=[0.99, 0.995, 0.98])
    assert report.ratios["shards_vs_limit_same_core"] == pytest.approx(0.97 * 0.99)
    table = report.table()
    assert "shards_vs_limit_same_core    0.96x " in table  # a reading, not judged
    assert "median of 3 passes: 0.970 (0.970 0.950 0.990)" in table and "99.0%" in table
    none = BenchReport.from_dict({**report.to_dict(), "same_core": [],
                                  "same_core_note": "1 worker(s) need 2 cores"})
    assert "shards_vs_limit_same_core" not in none.ratios
    assert "not measured: 1 worker(s) need 2 cores" in none.table()


def test_steal_seconds_is_read_from_proc_stat():
    first = bench.steal_seconds()
    assert first is not None and first >= 0.0
    assert bench.steal_seconds() >= first  # a counter since boot


@pytest.mark.parametrize("cores, workers", [(1, 1), (2, 1), (3, 2), (8, 4), (64, 4)])
def test_default_workers_leave_a_core_to_the_consumer(monkeypatch, cores, workers):
    """The limit counts one core per worker: by default the benchmark leaves one core to the process
    that takes the batches (never fewer than one worker, at most four)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert bench.default_workers() == workers


def test_bench_help_lists_loader(capsys):
    assert main(["bench"]) == 2
    assert "loader" in capsys.readouterr().out


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


def test_evict_drops_files_from_the_page_cache(tmp_path):
    if _fs_type(tmp_path.resolve()) == "tmpfs":
        pytest.skip("tmp_path is on tmpfs, whose files live only in the page cache")
    files = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(256 * 1024))
        files.append(p)
    for p in files:
        p.read_bytes()
    assert resident_fraction(files) > 0.9
    assert evict(files) == 3
    assert resident_fraction(files) < 0.1
    for p in files:
        p.read_bytes()
    assert resident_fraction(files) > 0.9


def test_the_limit_decodes_all_the_loaders_images_within_its_memory_budget(tmp_path):
    """The pipeline limit decodes every image the loader reads (a smaller sample would stay in the
    CPU's caches between passes); above the memory budget, every k-th file, spread over the set."""
    files = []
    for i in range(10):
        files.append(tmp_path / f"{i}.jpg")
        files[-1].write_bytes(bytes(100))
    assert bench.limit_sample(files) == files
    assert bench.limit_sample(files, max_bytes=1000) == files
    assert bench.limit_sample(files, max_bytes=999) == files[::2]
    assert bench.limit_sample(files, max_bytes=300) == files[::4]
