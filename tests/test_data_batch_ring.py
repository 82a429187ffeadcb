"""BatchRing: worker batches in reused shared-memory slots. A slot is reused only once nothing in the
training process can read it any more; batches held by the caller are never overwritten."""
from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

from gpu_lab.data import make_synthetic_images, shard_loader, write_shards
from gpu_lab.data.batch_ring import BatchRing, RingBatch

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_synthetic_images(root, 120, image_size=20, num_classes=4, seed=1)
    out = tmp_path_factory.mktemp("shards") / "s"
    write_shards(root, out, maxcount=15, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(shards):
    """key → image, decoded in this process (no workers, no ring), eval transform: deterministic."""
    ref = {}
    for x, _, keys in shard_loader(shards, 8, train=False, image_size=16, num_workers=0, rank=0,
                                   world_size=1, output="uint8", return_keys=True):
        ref.update(zip(keys, x.clone()))
    assert len(ref) == 120
    return ref


def _loader(shards, **kw):
    return shard_loader(shards, 4, train=False, image_size=16, num_workers=2, rank=0, world_size=1,
                        output="uint8", return_keys=True, pin_memory=False, **kw)


def test_views_kept_of_some_batches_survive_reuse_of_the_other_slots(shards, reference):
    """Keep a one-image view of every third batch and drop the rest: the dropped batches' slots
    are reused (30 batches through 2 x 5 slots), the kept views' slots must not be."""
    kept, from_ring = [], 0
    for i, (x, _, keys) in enumerate(_loader(shards)):
        from_ring += not x.is_shared()  # a ring slot is not a torch shared-memory segment
        for img, key in zip(x, keys):
            assert torch.equal(img, reference[key]), f"batch {i}: {key} differs on arrival"
        if i % 3 == 0:
            kept.append((x[0], keys[0]))  # a view: the batch tensor itself dies here
        del x
        gc.collect()
    assert from_ring >= 20, f"only {from_ring} of 30 batches came through the ring"
    for img, key in kept:
        assert torch.equal(img, reference[key]), f"{key} was overwritten while a view of it lived"


def test_holding_every_batch_falls_back_and_loses_nothing(shards, reference):
    batches = list(_loader(shards))
    assert sum(len(k) for _, _, k in batches) == 120
    shared = [x.is_shared() for x, _, _ in batches]
    assert not all(shared) and any(shared), "expected ring slots first, then fresh segments"
    for x, _, keys in batches:
        for img, key in zip(x, keys):
            assert torch.equal(img, reference[key])


def test_spawned_workers_cannot_inherit_the_ring_and_use_fresh_segments(shards, reference):
    loader = _loader(shards, multiprocessing_context="spawn")
    seen = 0
    for x, _, keys in loader:
        assert x.is_shared()
        for img, key in zip(x, keys):
            assert torch.equal(img, reference[key])
        seen += len(keys)
    assert seen == 120


def _worker_fill(ring: BatchRing, value: int, got) -> None:
    slot = ring.acquire(0)
    if slot is not None:
        ring.slot_tensor(slot, 2).fill_(value)
    got.put(slot)


def test_slot_is_released_when_the_last_view_dies_and_reused_after():
    ctx = mp.get_context("fork")
    ring = BatchRing(num_workers=1, slots_per_worker=1, slot_shape=(2, 3, 4, 4))
    got = ctx.Queue()
    p = ctx.Process(target=_worker_fill, args=(ring, 7, got))
    p.start()
    slot = got.get(timeout=60)
    p.join(60)
    assert slot == 0 and ring.in_use() == 1
    batch = RingBatch(ring.id, slot, 2, RingBatch.labels_bytes([3, 1]))
    images, labels = batch.materialize()
    assert images.shape == (2, 3, 4, 4) and bool((images == 7).all())
    assert labels.tolist() == [3, 1] and labels.dtype == torch.int64
    view = images[1, 0]
    del images
    gc.collect()
    assert ring.in_use() == 1, "released while a view still reads the slot"
    p = ctx.Process(target=_worker_fill, args=(ring, 9, got))
    p.start()
    assert got.get(timeout=60) is None, "a worker took a slot that is still read"
    p.join(60)
    assert bool((view == 7).all())
    del view
    gc.collect()
    assert ring.in_use() == 0
    p = ctx.Process(target=_worker_fill, args=(ring, 9, got))
    p.start()
    assert got.get(timeout=60) == 0
    p.join(60)


def test_a_ring_batch_outside_its_process_is_a_clear_error():
    with pytest.raises(RuntimeError, match="ring 123456 is gone"):
        RingBatch(123456, 0, 1, RingBatch.labels_bytes([0])).materialize()
