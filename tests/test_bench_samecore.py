"""The same-core measurement (bench.lib.samecore): each loader worker shares a core with a
limit process, both are followed through /proc, and nothing is left behind. Tiny sizes: this checks
the mechanics; bench/loader.py measures."""
from __future__ import annotations

import math
import os

import pytest

from bench.lib import samecore
from bench.lib.loader_method import timed_pass
from gpu_lab.data.loader import shard_loader
from gpu_lab.data.shards import image_folder_files, write_shards
from gpu_lab.data.synthetic import make_synthetic_images


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("samecore")
    make_synthetic_images(root / "images", 96, image_size=24, num_classes=3, seed=0)
    write_shards(root / "images", root / "shards", maxcount=12, progress=False)
    _, files = image_folder_files(root / "images")
    return root / "shards", [p.read_bytes() for p, _ in files[::4]]


def _loader(shard_dir, workers=1):
    return shard_loader(shard_dir, 8, image_size=16, num_workers=workers, rank=0, world_size=1,
                        pin_memory=False, output="uint8")


def test_each_worker_shares_its_core_with_a_limit_process_and_nothing_is_left(data):
    shard_dir, encoded = data
    assert samecore.supported(1) is None, "needs Linux and 2 cores (CI has them)"
    own = os.sched_getaffinity(0)
    before = samecore.child_pids()
    seen: list[tuple[set[int], dict[int, set[int]]]] = []

    def make():
        def batches():  # looks at who runs where in the middle of each pass
            for i, batch in enumerate(_loader(shard_dir)):
                if i == 3:
                    kids = samecore.child_pids() - before
                    seen.append((os.sched_getaffinity(0),
                                 {pid: os.sched_getaffinity(pid) for pid in kids}))
                yield batch
        return batches()

    ratios = samecore.same_core_passes(
        {"loader": make, "limit": lambda: samecore.limit_in_workers(encoded, 16, "basic", 8, 1)},
        1, encoded, 16, "basic", 8, passes=2)
    assert list(ratios) == ["loader", "limit"]
    assert all(len(r) == 2 and all(math.isfinite(x) and x > 0 for x in r) for r in ratios.values())
    assert len(seen) == 2
    cores = sorted(own)
    for main_cores, kids in seen:
        # the worker and the limit process on the first core, this process on the others
        assert len(kids) == 2 and all(aff == {cores[0]} for aff in kids.values()), kids
        assert main_cores == set(cores[1:])
    assert os.sched_getaffinity(0) == own
    assert samecore.child_pids() == before, "limit processes and workers must be gone"


def test_unavailable_where_a_worker_cannot_have_a_core_of_its_own(monkeypatch, data):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert samecore.supported(1) is None
    why = samecore.supported(2)
    assert "2 worker(s) need 3 cores" in why and "may use 2" in why
    assert "num_workers >= 1" in samecore.supported(0)
    with pytest.raises(RuntimeError, match="same-core measurement unavailable: 2 worker"):
        samecore.same_core_passes({"loader": lambda: _loader(data[0], 2)}, 2, data[1], 16, "basic",
                                  8)


@pytest.mark.slow  # over half a second
def test_worker_clock_gives_the_share_of_time_the_workers_decode(data):
    """Read at every batch by `timed_pass`: the workers' decoding threads' time on a CPU over the
    steady state, a share of the wall time (of each worker's)."""
    p, busy = timed_pass(_loader(data[0], 2), samecore.WorkerClock())
    assert busy is not None and 0.0 < busy <= 1.01 and p.images == 96
    no_workers = shard_loader(data[0], 8, image_size=16, num_workers=0, rank=0, world_size=1,
                              pin_memory=False, output="uint8")
    assert timed_pass(no_workers, samecore.WorkerClock())[1] is None  # no workers, no share


def test_task_cpu_ns_counts_threads_and_says_when_a_process_is_gone():
    me = os.getpid()
    # the main thread first: this thread keeps running between the reads, and the counters only
    # grow, so all threads read afterwards hold at least as much (the other order can lose)
    main_thread = samecore.task_cpu_ns(me, me)
    assert samecore.task_cpu_ns(me) >= main_thread > 0
    assert samecore.task_cpu_ns(2 ** 22 + 7) is None  # above the default pid_max: never a process


def test_calibration_runs_two_limit_processes_on_one_core_and_ends_them(data):
    own, before = os.sched_getaffinity(0), samecore.child_pids()
    ratios = samecore.calibrate(data[1], 16, "basic", 8, extra_us=50.0, windows=2, window_images=64)
    assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert os.sched_getaffinity(0) == own and samecore.child_pids() == before


@pytest.mark.parametrize("workers", [0, 2])
def test_the_limit_in_workers_decodes_every_image_once(data, workers):
    """The reference loader runs the limit's loop on the encoded images, split between its workers:
    every image once per pass, counted by len(batch[1]) as the loader's batches are."""
    encoded = data[1]
    batches = list(samecore.limit_in_workers(encoded, 16, "basic", 8, workers))
    assert sum(len(b[1]) for b in batches) == len(encoded)
    assert all(b[0] is None and 0 < len(b[1]) <= 8 for b in batches)
