"""shard_loader on real shards: exactly-once over ranks x workers, bad shards, no DDP hang, clear
errors, and a third-party WebDataset shard."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import psutil
import pytest
import torch

import gpu_lab
from gpu_lab.data import (ShardError, ShardManifest, make_synthetic_images, normalize_batch,
                          shard_loader, write_shards)

import data_fns
import proc_utils

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]
TESTDATA = ROOT.parent / "shared" / "testdata"
SAMPLE = TESTDATA / "webdataset-sample.tgz"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_synthetic_images(root, 100, image_size=20, num_classes=4, seed=0)
    return root


@pytest.fixture(scope="module")
def shards(images, tmp_path_factory):
    """9 shards of uneven sizes (12 x 8 + 4)."""
    out = tmp_path_factory.mktemp("shards") / "s"
    write_shards(images, out, maxcount=12, progress=False)
    return out


def _all_keys(n: int) -> list[str]:
    return [f"{i:08d}" for i in range(n)]


def _copy_shards(src: Path, dst: Path) -> ShardManifest:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return ShardManifest.load(dst)


# ------------------------------------------------------------------------------ where workers live
def test_a_temporary_folder_too_deep_for_workers_sockets_is_refused_before_they_start(
        shards, tmp_path, monkeypatch):
    """Workers pass tensors over Unix sockets under the temporary folder (at most 107 bytes a
    path): a 76-character TMPDIR made a DataLoader with workers hang; 75 works."""
    from gpu_lab.data.workers import check_socket_room
    from gpu_lab.train.data import make_loader

    deep = "/tmp/" + "d" * 71
    check_socket_room(deep[:-1])  # 75 characters: the longest that works
    with pytest.raises(ValueError, match=r"within 75 characters; this one .* has 76\. Set TMPDIR "
                                         r"to a shorter folder \(such as /tmp\), or use "
                                         r"num_workers=0"):
        check_socket_room(deep)
    monkeypatch.setattr("tempfile.tempdir", deep)
    with pytest.raises(ValueError, match="Set TMPDIR to a shorter folder"):
        next(iter(shard_loader(shards, 8, train=True, image_size=16, num_workers=2, rank=0,
                               world_size=1)))
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="Set TMPDIR to a shorter folder"):
        make_loader(data, batch_size=2, shuffle=True, num_workers=2, seed=0)
    assert len(list(shard_loader(shards, 8, train=True, image_size=16, num_workers=0, rank=0,
                                 world_size=1))) > 0  # without workers, nothing to refuse


# ------------------------------------------------------------------------------ exactly once

def test_two_ranks_two_workers_see_every_image_exactly_once(shards, tmp_path):
    """2 real rank processes (RANK/WORLD_SIZE as a launcher sets them), 2 workers each, 2 epochs."""
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(data_fns.__file__)), "read_keys", str(shards),
             str(tmp_path / f"rank{rank}.json")], env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    orders = []
    for epoch in (0, 1):
        per_rank = [r["epochs"][epoch] for r in results]
        keys = per_rank[0]["keys"] + per_rank[1]["keys"]
        assert sorted(keys) == _all_keys(100), f"epoch {epoch}: duplicates or gaps"
        assert not set(per_rank[0]["keys"]) & set(per_rank[1]["keys"])
        for r in per_rank:
            assert r["batches"] == r["len"], "len(loader) must match the batches delivered"
        orders.append(per_rank[0]["keys"])
    assert orders[0] != orders[1], "shuffling must change between epochs"


def test_one_process_epoch_sizes_and_eval_order(shards):
    loader = shard_loader(shards, 16, train=False, image_size=16, num_workers=0, rank=0, world_size=1,
                          return_keys=True)
    keys = [k for _, _, ks in loader for k in ks]
    again = [k for _, _, ks in loader for k in ks]
    assert keys == again and sorted(keys) == _all_keys(100)  # eval: fixed order, every sample
    assert loader.classes == ShardManifest.load(shards).classes
    assert "ShardLoader(shards=9, rank=0/1" in repr(loader)


# ------------------------------------------------------------------------------ bad shards

def test_truncated_shard_raises_naming_it(shards, tmp_path):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    victim = bad / m.shards[3].name
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2 + 700])  # cut inside a member
    loader = shard_loader(bad, 8, train=True, image_size=16, num_workers=2, rank=0, world_size=1)
    with pytest.raises(ShardError, match=rf"shard {victim}: TarFormatError: unexpected end of data"):
        for _ in loader:
            pass
    victim.write_bytes(data[: 2560 * 5])  # cut exactly between samples: tar alone cannot tell
    loader = shard_loader(bad, 8, train=True, image_size=16, num_workers=2, rank=0, world_size=1)
    with pytest.raises(ShardError, match=rf"shard {victim}: EOFError: ended after 5 of the 12 "
                                         rf"samples the manifest lists"):
        for _ in loader:
            pass


def test_truncated_shard_warn_policy_continues_and_counts_the_loss(shards, tmp_path, caplog):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    victim = bad / m.shards[3].name
    with tarfile.open(victim) as t:
        names = [x.name for x in t]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2 + 700])
    loader = shard_loader(bad, 8, train=True, image_size=16, num_workers=0, rank=0, world_size=1,
                          handler="warn", return_keys=True)
    keys = [k for _, _, ks in loader for k in ks]
    lost = set(n.split(".")[0] for n in names) - set(keys)
    assert 0 < len(lost) < 12
    assert sorted(keys + sorted(lost)) == _all_keys(100)
    assert loader.stats.skipped_samples == len(lost) and loader.stats.errors == 1
    assert f"shard {victim}" in caplog.text


def test_warn_policy_counts_across_worker_processes(shards, tmp_path):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    for i in (1, 6):  # two broken shards, likely read by different workers
        v = bad / m.shards[i].name
        v.write_bytes(v.read_bytes()[:700])
    loader = shard_loader(bad, 8, train=False, image_size=16, num_workers=2, rank=0, world_size=1,
                          handler="warn")
    n = sum(len(y) for _, y in loader)
    assert n + loader.stats.skipped_samples == 100
    assert loader.stats.errors == 2 and loader.stats.skipped_samples == 24


def test_corrupt_image_raises_naming_shard_and_sample_or_is_skipped(shards, tmp_path):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    victim = bad / m.shards[2].name
    with tarfile.open(victim) as t:
        member = next(x for x in t if x.name.endswith(".jpg"))
    raw = bytearray(victim.read_bytes())
    raw[member.offset_data:member.offset_data + 64] = bytes(64)  # JPEG header zeroed, tar intact
    victim.write_bytes(bytes(raw))
    key = member.name.split(".")[0]
    loader = shard_loader(bad, 8, train=False, image_size=16, num_workers=2, rank=0, world_size=1)
    with pytest.raises(ShardError, match=rf"shard {victim}: sample '{key}'"):
        list(loader)
    loader = shard_loader(bad, 8, train=False, image_size=16, num_workers=2, rank=0, world_size=1,
                          handler="warn", return_keys=True)
    keys = [k for _, _, ks in loader for k in ks]
    assert key not in keys and len(keys) == 99
    assert loader.stats.skipped_samples == 1


@pytest.mark.parametrize("name", ["00000001.jpg", "a/b.seg.png", "a.b/c.d", "dir/.hidden", ".x.jpg",
                                  "noext", "a/b", "x/y.", "ü/ö.cls", "a//b.c", "/abs.jpg", "a.b.c.d"])
def test_members_group_into_samples_as_webdataset_groups_them(name):
    from webdataset.tariterators import base_plus_ext

    from gpu_lab.data.loader import split_key

    assert split_key(name) == base_plus_ext(name)


def test_in_bursts_keeps_every_sample_in_order_and_pulls_them_a_burst_at_a_time():
    from gpu_lab.data.loader import in_bursts

    pulled: list[int] = []

    def upstream():
        for i in range(10):
            pulled.append(i)
            yield i

    it = in_bursts(upstream(), 4)
    assert next(it) == 0 and pulled == [0, 1, 2, 3]  # a burst is read before its first is used
    assert [next(it) for _ in range(3)] == [1, 2, 3] and len(pulled) == 4
    assert next(it) == 4 and len(pulled) == 8
    assert list(it) == [5, 6, 7, 8, 9] and pulled == list(range(10))
    assert list(in_bursts([], 4)) == []


def test_corrupt_tar_header_is_caught(shards, tmp_path):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    victim = bad / m.shards[0].name
    raw = bytearray(victim.read_bytes())
    with tarfile.open(victim) as t:
        third = list(t)[4]
    raw[third.offset + 100:third.offset + 108] = b"garbage!"
    victim.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=rf"shard {victim}: TarFormatError: corrupt tar header"):
        list(shard_loader(bad, 8, train=False, image_size=16, num_workers=0, rank=0, world_size=1))


@pytest.fixture(scope="module")
def long_shards(images, tmp_path_factory):
    """2 shards of 300 samples (the 100 images three times over): longer than what a worker reads
    ahead, so a worker is still reading a shard when the test receives its first batch."""
    files = sorted(p for p in images.rglob("*") if p.is_file())
    samples = [{"__key__": f"{i:05d}", "jpg": files[i % 100].read_bytes(), "cls": 0}
               for i in range(600)]
    out = tmp_path_factory.mktemp("long") / "s"
    write_shards(samples, out, maxcount=300, progress=False)
    return out


@pytest.mark.parametrize("cut", ["inside an image", "between the members of a sample"])
@pytest.mark.parametrize("handler", ["raise", "warn"])
def test_shard_truncated_while_two_workers_read_it_is_a_shard_error(long_shards, tmp_path,
                                                                      handler, cut):
    """The shard shrinks under a running worker: a ShardError naming it ('raise'), or a counted
    skip ('warn'), and no worker killed by a signal (a memory-mapped shard gave SIGBUS here)."""
    bad = tmp_path / "bad"
    m = _copy_shards(long_shards, bad)
    victim = bad / m.shards[0].name
    with tarfile.open(victim) as t:
        members = {x.name: x for x in t}
    at = (members["00150.jpg"].offset_data + 100 if cut == "inside an image"
          else members["00150.cls"].offset)  # a cut a block-wise copy can make
    loader = shard_loader(bad, 2, train=False, image_size=16, num_workers=2, rank=0, world_size=1,
                          handler=handler, return_keys=True, prefetch_factor=2)
    children = {p.pid for p in psutil.Process().children()}
    it = iter(loader)
    keys = list(next(it)[2])  # worker 0 has opened shard 0 and read its first samples
    os.truncate(victim, at)
    if handler == "raise":
        with pytest.raises(ShardError, match=rf"shard {victim}: (TarFormatError|EOFError)"):
            for batch in it:
                keys += batch[2]
        # the workers are stopped with the error, not whenever the garbage collector gets to them
        assert {p.pid for p in psutil.Process().children()} <= children
        return
    for batch in it:
        keys += batch[2]
    assert loader.stats.errors == 1
    # what the worker delivered of the shard: the samples before the cut (the one just before a
    # cut inside a member is counted lost with it: it is only known whole when the next begins)
    got = sorted(k for k in keys if int(k) < 300)
    assert got == [f"{i:05d}" for i in range(len(got))] and len(got) in (149, 150)
    assert loader.stats.skipped_samples == 300 - len(got)  # every sample counted exactly once
    assert sorted(k for k in keys if int(k) >= 300) == [f"{i:05d}" for i in range(300, 600)]


def test_a_read_that_never_returns_is_a_loader_stall_error(shards, tmp_path):
    """A shard whose read blocks forever (here a named pipe without a writer; on a real system a
    hung network filesystem): after `timeout` s without a batch, LoaderStallError names the rank
    and the shards instead of a silent hang, and the stuck worker, which ignores SIGTERM like every
    gpu_lab loader worker, is killed rather than left behind."""
    from gpu_lab.data import LoaderStallError

    stuck = tmp_path / "stuck"
    m = _copy_shards(shards, stuck)
    fifo = stuck / m.shards[1].name
    fifo.unlink()
    os.mkfifo(fifo)
    loader = shard_loader(stuck, 8, train=False, image_size=16, num_workers=1, rank=0,
                          world_size=1, timeout=2)
    children = {p.pid for p in psutil.Process().children()}
    got = 0
    with pytest.raises(LoaderStallError, match=r"no batch from the 1 DataLoader workers of rank 0 "
                                               rf"in 2 s \(shards in {stuck}\)"):
        for _, y in loader:
            got += len(y)
    assert got <= 12  # at most the first shard: the worker reads ahead into the stuck one
    assert {p.pid for p in psutil.Process().children()} <= children
    with pytest.raises(ValueError, match=r"timeout=-1: expected seconds >= 0"):
        shard_loader(stuck, 8, timeout=-1)


def _stop_signals_in_a_worker(q) -> None:
    import signal

    from gpu_lab.data.workers import IGNORED_SIGNALS as STOP_SIGNALS, ignore_stop_signals

    at_start = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.kill(os.getpid(), signal.SIGTERM)  # a stop to the group while the worker is starting
    ignore_stop_signals()
    q.put((sorted(int(s) for s in STOP_SIGNALS if s in at_start),
           sorted(int(s) for s in STOP_SIGNALS if s in signal.pthread_sigmask(signal.SIG_BLOCK, []))))


def test_loader_workers_survive_a_stop_that_arrives_while_they_start():
    """Workers start with the stop signals blocked, so a SIGTERM to the process group between the
    fork and ignore_stop_signals (where PyTorch's own worker handler would die of it) is dropped;
    afterwards nothing stays blocked, and the starting process's mask is as it was."""
    import signal

    from gpu_lab.data.workers import IGNORED_SIGNALS as STOP_SIGNALS, worker_options

    ctx = worker_options()["multiprocessing_context"]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_stop_signals_in_a_worker, args=(q,), daemon=True)
    p.start()
    p.join(30)
    assert p.exitcode == 0, f"the worker died: exit code {p.exitcode}"
    blocked_at_start, blocked_after = q.get()
    assert blocked_at_start == sorted(int(s) for s in STOP_SIGNALS) and blocked_after == []
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert worker_options("spawn")["multiprocessing_context"].get_start_method() == "spawn"


def test_stop_checkpoints_a_run_that_reads_shards_with_workers(shards, tmp_path, gpu_lab_home):
    """Stop sends SIGTERM to the run's whole process group, the loader's workers included: the
    workers must leave it to the training process, which checkpoints at the step boundary, or the
    run ends on "DataLoader worker killed" with nothing saved."""
    from gpu_lab.train import train_classifier

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        (data / split).symlink_to(shards, target_is_directory=True)
    cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, num_classes=4, batch_size=4,
                              epochs=1000, augment="none", num_workers=2, data_dir=str(data),
                              output_dir=str(tmp_path / "runs"), tensorboard=False)
    run = gpu_lab.launch(train_classifier, cfg, name="shards-stop")
    try:
        proc_utils.wait_until(lambda: run.done or run.metrics.count("loss", 0) >= 2, 180,
                              what="two logged steps")
        assert not run.done, run.logs(0)
        assert run.stop() == "stopped", run.logs(None) + run.logs(0) + run.logs(1)
    finally:
        if not run.done:
            run.stop()
    logs = run.logs(0)
    assert "killed by signal" not in logs, logs
    saved = sorted(Path(run.output_dir).glob("checkpoints/step_*"))
    assert saved, f"no checkpoint after the stop: {logs}"
    assert int(saved[-1].name.split("_")[1]) >= 2


def test_vanished_shard_is_a_shard_error_or_a_counted_skip(shards, tmp_path):
    bad = tmp_path / "bad"
    m = _copy_shards(shards, bad)
    gone = bad / m.shards[4].name
    loader = shard_loader(bad, 8, train=False, image_size=16, num_workers=2, rank=0, world_size=1)
    gone.unlink()  # after the loader was built, before a worker opens it
    with pytest.raises(ShardError, match=rf"shard {gone}: FileNotFoundError"):
        list(loader)
    loader = shard_loader(bad, 8, train=False, image_size=16, num_workers=2, rank=0, world_size=1,
                          handler="warn")
    assert sum(len(y) for _, y in loader) == 100 - 12
    assert (loader.stats.errors, loader.stats.skipped_samples) == (1, 12)


@pytest.mark.parametrize("n_shards", [1, 2, 5])
def test_eval_loader_reads_every_sample_once_over_ranks_and_workers(images, tmp_path, n_shards):
    """train=False with any number of shards, fewer than ranks x workers included (then split by
    sample): over all ranks every sample exactly once, and len(loader) is each rank's batches."""
    out = tmp_path / "s"
    write_shards(images, out, maxcount={1: 100, 2: 60, 5: 23}[n_shards], progress=False)
    assert len(ShardManifest.load(out).shards) == n_shards  # 100; 60 + 40; 4 x 23 + 8
    for world, workers in ((1, 0), (1, 2), (2, 0), (2, 2), (3, 2)):
        keys = []
        for rank in range(world):
            loader = shard_loader(out, 7, train=False, image_size=16, num_workers=workers,
                                  rank=rank, world_size=world, return_keys=True)
            mine = [k for _, _, ks in loader for k in ks]
            batches = -(-len(mine) // 7) if mine else 0
            assert len(loader) >= batches and mine, (world, workers, rank)
            assert sum(1 for _ in loader) == len(loader), "len(loader) is the batches delivered"
            keys += mine
        assert sorted(keys) == _all_keys(100), f"{world} ranks x {workers} workers"


# ------------------------------------------------------------------------------ ranks, DDP

def test_too_few_shards_message_gives_the_numbers(images, tmp_path):
    write_shards(images, tmp_path / "three", maxcount=34, progress=False)  # 3 shards
    with pytest.raises(ValueError) as e:
        shard_loader(tmp_path / "three", 8, num_workers=2, rank=1, world_size=2)
    msg = str(e.value)
    assert "3 shard(s) for 2 rank(s) x 2 worker(s) = 4 readers" in msg
    assert "resampled=True" in msg
    loader = shard_loader(tmp_path / "three", 8, num_workers=2, rank=1, world_size=2, resampled=True)
    assert len(loader) == 100 // (2 * 8)


def test_resampled_gives_every_rank_the_same_number_of_batches(shards):
    """Without resampling these uneven shards give the two ranks different batch counts (the
    DDP hang); with resampling both get exactly epoch_size // (world * batch) batches."""
    plain = [len(shard_loader(shards, 8, num_workers=1, rank=r, world_size=2)) for r in (0, 1)]
    assert plain[0] != plain[1]
    counts = []
    for r in (0, 1):
        loader = shard_loader(shards, 8, num_workers=2, rank=r, world_size=2, resampled=True,
                              image_size=16)
        assert len(loader) == 100 // 16
        counts.append([sum(1 for _ in loader) for _ in range(2)])
    assert counts == [[6, 6], [6, 6]]
    loader = shard_loader(shards, 8, num_workers=0, rank=0, world_size=1, resampled=True,
                          epoch_size=40, image_size=16)
    assert len(loader) == 5 and sum(1 for _ in loader) == 5


def test_two_rank_gloo_training_on_uneven_shards_finishes(shards):
    """Through gpu_lab.launch, the path users take: 2 gloo ranks, DDP all-reduce each step."""
    run = gpu_lab.launch(data_fns.train_on_shards, str(shards), num_processes=2, name="shards-ddp")
    try:
        status = run.wait(240)
    finally:
        if not run.done:
            run.stop()
    steps = {r: run.metrics.count("loss", r) for r in (0, 1)}  # a hang shows as steps < 12
    assert status == "succeeded", (f"{status}, steps reported per rank {steps}: " + run.logs(None)
                                   + run.logs(0) + run.logs(1))
    ranks = sorted(run.result()["ranks"])
    assert [r[0] for r in ranks] == [0, 1] and [r[3:] for r in ranks] == [[0, 2], [1, 2]]
    steps = {r[1] for r in ranks}
    assert steps == {2 * (100 // 16)}, ranks  # 2 epochs x 6 batches, on both ranks


# ------------------------------------------------------------------------------ options

def test_uint8_output_normalized_later_equals_float_output(shards):
    kw = dict(train=False, image_size=16, num_workers=0, rank=0, world_size=1)
    xf, yf = next(iter(shard_loader(shards, 10, **kw)))
    xu, yu = next(iter(shard_loader(shards, 10, output="uint8", **kw)))
    assert xu.dtype == torch.uint8 and xf.dtype == torch.float32
    assert torch.equal(yf, yu) and torch.allclose(normalize_batch(xu), xf, atol=1e-5)


def test_workers_hand_over_uint8_and_the_loader_normalises_on_its_device(shards):
    """Two workers ship uint8 batches (a quarter of float32's bytes through shared memory); the
    loader normalises after the move to `device`, and the result equals the uint8 batch
    normalised by hand."""
    kw = dict(train=False, image_size=16, num_workers=2, rank=0, world_size=1)
    raw = list(shard_loader(shards, 10, output="uint8", **kw))
    done = list(shard_loader(shards, 10, device="cpu", **kw))
    assert [x.dtype for x, _ in raw] == [torch.uint8] * len(raw)
    assert len(done) == len(raw) and all(x.device.type == "cpu" for x, _ in done)
    for (xu, yu), (xf, yf) in zip(raw, done):
        assert xf.dtype == torch.float32 and torch.equal(yu, yf)
        assert torch.allclose(normalize_batch(xu), xf, atol=1e-5)


@pytest.mark.parametrize("augment", ["none", "basic", "autoaugment"])
def test_augment_levels_give_training_batches(shards, augment):
    x, y = next(iter(shard_loader(shards, 8, image_size=16, augment=augment, num_workers=0,
                                  rank=0, world_size=1)))
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.long
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"augment": "heavy"}, r"augment='heavy': expected one of \['none', 'basic', 'autoaugment'\]"),
    ({"handler": "ignore"}, r"handler='ignore': expected one of \['raise', 'warn'\]"),
    ({"output": "fp16"}, r"output='fp16'"),
    ({"device": "gpu0"}, r"device='gpu0': expected None, a torch.device or a device string"),
    ({"batch_size": 0}, r"batch_size=0"),
    ({"rank": 2, "world_size": 2}, r"rank=2: expected an int in \[0, 1\]"),
    ({"epoch_size": 10}, r"epoch_size is only used with resampled=True"),
])
def test_bad_arguments_are_named(shards, kwargs, match):
    args = {"batch_size": 8, "num_workers": 0, "rank": 0, "world_size": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        shard_loader(shards, **args)


# ------------------------------------------------------------------------------ real data

@pytest.fixture
def sample_shard():
    if not SAMPLE.exists():
        pytest.skip(f"third-party shard not present: {SAMPLE} (the ../shared/testdata folder of the "
                    f"project checkout)")
    return SAMPLE


def test_third_party_shard_decodes_all_90_samples(sample_shard):
    loader = shard_loader(str(sample_shard), 32, train=False, image_size=28, num_workers=0,
                          return_keys=True)
    images, labels, keys = [], [], []
    for x, y, k in loader:
        images.append(x)
        labels += y.tolist()
        keys += k
    x = torch.cat(images)
    assert x.shape == (90, 3, 28, 28)  # grey 28 px PNGs come out as RGB
    assert len(set(keys)) == 90 and all(0 <= c <= 9 for c in labels) and len(set(labels)) > 5
    with pytest.raises(TypeError, match="length unknown"):
        len(loader)
