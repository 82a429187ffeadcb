"""The loader benchmark end to end (tiny sizes: this checks the plumbing, bench/loader.py measures),
and the page-cache eviction that its cold runs rely on (as `gpu-lab bench io` does)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_lab.cli import main
from gpu_lab.diagnostics import loaderbench as bench
from gpu_lab.diagnostics import loaderpasses
from gpu_lab.diagnostics.loaderbench import BenchReport
from gpu_lab.data.pagecache import evict, resident_fraction


@pytest.mark.slow  # over half a second
def test_bench_loader_cli_reports_every_measurement(tmp_path, capsys):
    rc = main(["bench", "loader", "--n", "96", "--image-size", "40", "--crop-size", "32",
               "--workers", "2", "--batch-size", "16", "--steps", "3", "--work-dir", str(tmp_path),
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
    # the limit counts a core per worker
    assert d["rates"]["limit"] == pytest.approx(d["limit_one_core"] * 2) and d["parallel_limit"] > 0
    assert d["ratios"]["shards_vs_limit"] == pytest.approx(d["rates"]["shards_warm"] / d["rates"]["limit"])
    assert 0.0 <= d["data_wait"]["shards"] <= 1.0 and 0.0 <= d["data_wait"]["naive"] <= 1.0
    assert d["n_images"] == 96 and d["num_shards"] >= 1 and d["writer_images_per_minute"] > 0
    assert d["zstd_ratio"] > 1.0  # tar headers and padding compress
    assert (tmp_path / "last_report.json").exists()
    assert not list(tmp_path.glob("shards-*")), "temporary shards must be removed"
    # the table names every figure
    table = BenchReport.from_dict(d).table()
    for text in ("naive per-file PIL (warm)", "gpu_lab shard_loader (cold)", "pipeline limit",
                 "shard_loader, normalised on CPU (warm)",
                 "naive path on one core", "img/CPU-s", "pipeline in 2 processes at once",
                 "shards_vs_naive", "data-wait fraction", "zstd: shard files"):
        assert text in table


def test_bench_loader_takes_plain_flags_only(capsys):
    """The measurement method's flags belong to bench/loader.py, not to the user's command."""
    for flag in ("--pairs", "--same-core"):
        with pytest.raises(SystemExit):
            main(["bench", "loader", flag, "2"])
        assert f"unrecognized arguments: {flag} 2" in capsys.readouterr().err


def test_throughput_clock_stops_at_the_last_batch(monkeypatch):
    """A loader's rate runs from the first batch to the last: neither its start-up nor the time it
    takes to end after the last batch (a DataLoader joins its workers there) counts."""
    clock = [0.0]
    monkeypatch.setattr(loaderpasses.time, "perf_counter", lambda: clock[0])

    def loader():
        clock[0] += 50.0  # start-up, before the first batch
        for _ in range(5):
            yield (None, [0] * 10)  # (images, labels): 10 images a batch, one second apart
            clock[0] += 1.0
        clock[0] += 100.0  # shutdown, after the last batch

    p = loaderpasses.throughput(loader())
    assert p.images == 50
    assert p.rate == pytest.approx(40 / 4.0)  # the 4 batches after the first, over 4 seconds


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
    assert loaderpasses.limit_sample(files) == files
    assert loaderpasses.limit_sample(files, max_bytes=1000) == files
    assert loaderpasses.limit_sample(files, max_bytes=999) == files[::2]
    assert loaderpasses.limit_sample(files, max_bytes=300) == files[::4]
