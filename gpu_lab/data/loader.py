# Long: the shard loader's stages (shard lists, per-worker reading, grouping, shuffling,
# batching) share one error policy and its counters.
"""`shard_loader`: WebDataset shards → augmented, batched tensors, on N ranks x M workers.

The pipeline, per DataLoader worker, as small stages (webdataset's style):

    shard list ─ shuffle (same order on every rank, new each epoch) ─ split_by_node ─ split_by_worker
       (or: resampled, an endless random draw of shards per rank and worker)
    ─ read tar (.tar: one readv per member; .tar.gz, .tar.zst streamed) ─ group members into samples
    ─ shuffle buffer ─ in bursts of 64 ─ decode (torchvision.io) ─ v2 transforms on uint8
    ─ uint8 batch, stacked into a reused shared-memory slot (`BatchRing`)
    → DataLoader(batch_size=None): worker processes, prefetch, pinned memory
    → in the training process: to `device` ─ normalise the batch there (one fused pass)

Workers hand over uint8 batches: a quarter of the bytes of float32 through shared memory, pinned
memory and PCIe. They stack each batch into a slot of shared memory that the training process
mapped once, before they forked, and reuse a slot once nothing reads it any more: only a slot number
crosses the pipe, instead of torch's fresh segment, page faults and file-descriptor handshake per
batch (see `batch_ring`). The normalisation then runs where the batch lands, on the GPU when
`device` is one.

Rules it enforces:

- **No duplicates, no gaps:** shards are shuffled with a seed shared by all ranks *before* they are
  split, so over one epoch the ranks x workers read disjoint shards that cover the set.
- **No hangs under DDP:** without resampling, ranks get whole shards and so, in general, different
  numbers of batches; the rank that runs out stops calling all-reduce and the others wait forever.
  `resampled=True` draws shards with replacement and cuts every rank at the same number of batches
  (`epoch_size` samples per epoch over all ranks; webdataset's `with_epoch`, applied per worker and
  again per rank), which is what a DDP training loop needs.
- **Too few shards:** for training without resampling, fewer shards than ranks x workers would
  leave some reader idle (and, under DDP, hang the others): that is an error with the numbers,
  before any worker starts. An evaluation loader (`train=False`) splits by sample instead where a
  level (ranks, then a rank's workers) has fewer shards than readers: every reader of that level
  reads all of its shards and keeps every n-th sample, so any number of shards is read exactly once.
- **Errors name the shard:** by default (`handler="raise"`) the first unreadable shard or sample
  raises `ShardError("shard <path>: ...")`; `handler="warn"` logs it, skips it and counts what was
  skipped in `loader.stats` (shared by all worker processes). With a manifest, a truncated shard
  counts every sample it lost, not just one. A shard that shrinks while a worker reads it, or
  vanishes before, is a ShardError like any other: plain tar shards are read (`tario.
  iter_file_members`), never memory-mapped, so a truncation cannot kill a worker with SIGBUS.

Do not pass the loader through `accelerator.prepare`: it already splits the data by rank.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import random
import traceback
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import base_plus_ext

from ..config import StrEnum
from . import gpu_decode
from .batch_ring import BatchRing, RingBatch
from .shards import ShardManifest, resolve_shards
from .tario import shard_members
from .workers import check_socket_room, end_workers, worker_options
from .transforms import (CROP_SCALE, IMAGE_KEYS, build_transform, check_augment, decode, image_key,
                         normalize_batch, parse_label)

log = logging.getLogger("gpu_lab.data")


class ErrorPolicy(StrEnum):
    RAISE = "raise"
    WARN = "warn"


class Output(StrEnum):
    FLOAT32 = "float32"  # normalised after the move to the loader's device
    UINT8 = "uint8"  # as decoded: normalise yourself with transforms.normalize_batch


class ShardError(RuntimeError):
    """A shard, or a sample in it, could not be read. The message starts with `shard <path>:`."""


class LoaderStallError(RuntimeError):
    """The workers delivered no batch within the loader's `timeout`: a silent hang made an error."""


class LoaderStats:
    """Counters that every worker process of one loader adds to (shared memory)."""

    def __init__(self, ctx: Any = None) -> None:
        ctx = ctx if ctx is not None else mp.get_context()
        self._skipped = ctx.Value("q", 0)
        self._errors = ctx.Value("q", 0)

    def add(self, skipped: int, errors: int = 1) -> None:
        with self._skipped.get_lock():
            self._skipped.value += skipped
        with self._errors.get_lock():
            self._errors.value += errors

    @property
    def skipped_samples(self) -> int:
        """Samples lost to errors (a truncated shard with a known count loses all it did not yield)."""
        return self._skipped.value

    @property
    def errors(self) -> int:
        """Errors handled (one per bad shard or bad sample)."""
        return self._errors.value

    def __repr__(self) -> str:
        return f"LoaderStats(skipped_samples={self.skipped_samples}, errors={self.errors})"


def _empty_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory when in a DataLoader worker, so the batch crosses
    to the main process without a copy (the same trick torch's default_collate uses)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    proto = torch.empty(0, dtype=dtype)
    storage = proto._typed_storage()._new_shared(math.prod(shape), device=proto.device)
    return proto.new(storage).resize_(*shape)


def split_key(name: str) -> tuple[str | None, str | None]:
    """A tar member's name → (sample key, extension), as WebDataset groups members: the key is the
    path up to the first dot of the file name (`a/b.seg.png` → `a/b`, `seg.png`). Plain string
    operations for the usual names; webdataset's own regex for the rest (no dot, or a leading one)."""
    start = name.rfind("/") + 1
    dot = name.find(".", start)
    if dot > start:
        return name[:dot], name[dot + 1:]
    return base_plus_ext(name)


# Samples are read (and shuffled) this many at a time, then decoded this many in a row.
BURST = 64


def in_bursts(samples: Iterable, n: int) -> Iterator:
    """The same samples in the same order, pulled from upstream `n` at a time.

    Reading, grouping and shuffling are many small Python steps. Interleaved one sample at a time
    with decoding and cropping (large C kernels that push the interpreter's code and data out of
    the CPU caches) they cost over twice what they cost in a loop of their own (reading and
    grouping: ~10 us per sample in a loop; ~23 us one at a time beside decode + crop, ~14 us in
    bursts). Measured in one DataLoader worker on 160 px JPEGs, medians of 8 alternated epochs of
    10,000 images: 40 -> 29 us per image outside decode + crop, about 3% of the worker's time.
    """
    it = iter(samples)
    while True:
        burst = list(islice(it, n))
        if not burst:
            return
        yield from burst


def _reraise(exn: Exception) -> bool:
    raise exn


def _warn_and_skip(exn: Exception) -> bool:
    log.warning("gpu_lab.data: skipped: %s", exn)
    return True


def _policy(handler: str | Callable[[Exception], bool]) -> Callable[[Exception], bool]:
    """'raise' | 'warn' | a webdataset-style handler (exception → True to continue) → callable.
    The built-in policies are module-level functions, so spawn/forkserver workers can unpickle them."""
    if callable(handler):
        return handler
    try:
        pol = ErrorPolicy(handler)
    except ValueError:
        raise ValueError(f"handler={handler!r}: expected one of {ErrorPolicy.choices()} or a callable "
                         f"(exception) -> bool") from None
    return _reraise if pol is ErrorPolicy.RAISE else _warn_and_skip


class ShardDataset(IterableDataset):
    """The per-worker pipeline. Build it through `shard_loader`; it is public for custom loaders."""

    def __init__(self, urls: list[str], *, counts: dict[str, int] | None, rank: int, world_size: int,
                 train: bool, shard_shuffle: bool, resampled: bool, seed: int, shuffle_buffer: int,
                 transform: Callable, batch_size: int, partial: bool, handler: Callable,
                 stats: LoaderStats, return_keys: bool, batches_per_worker: int | None,
                 handover: Callable | None = None) -> None:
        super().__init__()
        self.urls, self.counts = urls, counts or {}
        self.rank, self.world_size = rank, world_size
        self.train, self.shard_shuffle, self.resampled = train, shard_shuffle, resampled
        self.seed, self.epoch = seed, 0
        self.shuffle_buffer, self.transform = shuffle_buffer, transform
        self.batch_size, self.partial = batch_size, partial
        self.handler, self.stats = handler, stats
        self.return_keys = return_keys
        self.batches_per_worker = batches_per_worker
        self.handover = handover  # decode="gpu": keep the encoded bytes, draw the crop (gpu_decode)
        self.ring: BatchRing | None = None  # set by ShardLoader for each epoch, before workers fork

    # -- shard assignment -------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> list[str]:
        """All shards in this epoch's order: the same on every rank (seeded by seed and epoch)."""
        order = list(self.urls)
        if self.shard_shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def share(self, epoch: int, worker: int, num_workers: int) -> tuple[list[str], int, int]:
        """(shards, stride, offset): what (this rank, `worker`) reads in `epoch` when not
        resampled, and of their samples (counted in that order) the ones at `offset` modulo
        `stride`. Whole shards while there are enough: split_by_node, then split_by_worker, over
        the shared order (stride 1). Where a level has fewer shards than readers (an evaluation set
        of a few shards), every reader of that level reads all of them and keeps every n-th sample."""
        shards, stride, offset = self.epoch_order(epoch), 1, 0
        for part, parts in ((self.rank, self.world_size), (worker, num_workers)):
            if stride == 1 and len(shards) >= parts:
                shards = shards[part::parts]
            else:
                offset += stride * part
                stride *= parts
        return shards, stride, offset

    def assigned(self, epoch: int, worker: int, num_workers: int) -> list[str]:
        """The shards that (this rank, `worker`) reads in `epoch` when not resampled."""
        return self.share(epoch, worker, num_workers)[0]

    def _resampled(self, rng: random.Random) -> Iterator[str]:
        while True:  # endless; the loader stops every rank after the same number of batches
            yield rng.choice(self.urls)

    # -- stages -----------------------------------------------------------------------------
    def _read(self, shards: Iterable[str], stride: int = 1, offset: int = 0) -> Iterator[dict]:
        """Tar members → samples {'__key__', '__url__', ext: data}, grouped by key (data: a
        bytearray per member for plain tar shards, bytes for compressed ones); of the samples,
        counted over `shards` in order, those at `offset` modulo `stride`."""
        failures_in_a_row = 0
        start = 0  # the stream position of the shard's first sample
        for url in shards:
            n = 0
            expected = self.counts.get(url)
            try:
                with shard_members(url) as members:
                    current: dict | None = None
                    previous: dict | None = None
                    for name, data in members:
                        prefix, suffix = split_key(name)
                        if prefix is None:
                            continue
                        if current is None or current["__key__"] != prefix:
                            if current is not None:
                                if (start + n) % stride == offset:
                                    yield current
                                n += 1
                            previous = current
                            current = {"__key__": prefix, "__url__": url}
                        current[suffix.lower()] = data
                    # a shard cut between two members of its last sample ends cleanly for tar;
                    # when the manifest says it is short, a last sample with fewer members than
                    # the one before it is part of what was lost, not a bad sample of its own
                    if current is not None and not (
                            expected is not None and n + 1 < expected and previous is not None
                            and current.keys() != previous.keys()):
                        if (start + n) % stride == offset:
                            yield current
                        n += 1
                if expected is not None and n < expected:
                    raise EOFError(f"ended after {n} of the {expected} samples the manifest lists "
                                   f"(truncated?)")
                failures_in_a_row = 0
            except Exception as exn:  # any read error of this shard goes to the policy, named
                # one error, counted by the reader whose share the failure hit (of the readers
                # that share a shard by sample); the samples lost: with a manifest, this reader's
                # share of what the shard did not deliver, else at least the one that failed
                counted = (start + n) % stride == offset
                first = start + n + (offset - start - n) % stride
                lost = (len(range(first, start + expected, stride)) if expected is not None
                        else int(counted))
                err = ShardError(f"shard {url}: {type(exn).__name__}: {exn} "
                                 f"(after {n} samples; {lost} lost)")
                err.__cause__ = exn
                go_on = self.handler(err)  # raises under the default policy
                self.stats.add(skipped=lost, errors=int(counted))
                if not go_on:
                    return
                failures_in_a_row += 1
                if self.resampled and failures_in_a_row >= max(20, 2 * len(self.urls)):
                    raise ShardError(f"shard {url}: {failures_in_a_row} shard reads failed in a row; "
                                     f"giving up (are all {len(self.urls)} shards bad?)") from exn
            # every reader of a shard counts the samples the manifest lists, so the readers that
            # share it keep agreeing on the positions after a truncated one
            start += expected if expected is not None else n

    def _decode(self, samples: Iterable[dict]) -> Iterator[tuple[torch.Tensor, int, str]]:
        for s in samples:
            try:
                k = image_key(s)
                if k is None:
                    raise ValueError(f"no image member (expected one of {IMAGE_KEYS}); members: "
                                     f"{sorted(x for x in s if not x.startswith('__'))}")
                if "cls" not in s:
                    raise ValueError("no .cls member (the class label)")
                img = (self.transform(decode(s[k])) if self.handover is None
                       else self.handover(s[k], k))
                label = parse_label(s["cls"])
            except Exception as exn:  # noqa: BLE001 - a bad sample goes to the policy, named
                err = ShardError(f"shard {s['__url__']}: sample {s['__key__']!r}: "
                                 f"{type(exn).__name__}: {exn}")
                err.__cause__ = exn
                go_on = self.handler(err)
                self.stats.add(skipped=1)
                if not go_on:
                    return
                continue
            yield img, label, s["__key__"]

    def _collate(self, samples: list[tuple[torch.Tensor, int, str]]):
        if self.handover is not None:
            return gpu_decode.encoded_batch(samples, self.return_keys, _empty_shared)
        ring, info = self.ring, get_worker_info()
        if ring is not None and info is not None and samples[0][0].shape == ring.slot_shape[1:]:
            slot = ring.acquire(info.id)
            if slot is not None:  # stacked straight into shared memory that is already mapped
                torch.stack([s[0] for s in samples], out=ring.slot_tensor(slot, len(samples)))
                return RingBatch(ring.id, slot, len(samples),
                                 RingBatch.labels_bytes([s[1] for s in samples]),
                                 [s[2] for s in samples] if self.return_keys else None)
        shape = (len(samples), *samples[0][0].shape)
        images = torch.stack([s[0] for s in samples], out=_empty_shared(shape, torch.uint8))
        labels = torch.tensor([s[1] for s in samples], dtype=torch.long)
        if self.return_keys:
            return images, labels, [s[2] for s in samples]
        return images, labels

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # One seed per (seed, epoch, rank, worker): shuffles and augmentations differ across
        # readers and epochs, and a rerun repeats them.
        tag = f"{self.seed}/{self.epoch}/{self.rank}/{worker}"
        rng = random.Random(tag)
        if info is not None:  # only in a worker process: never reseed the training process
            torch.manual_seed(random.Random(tag + "/torch").getrandbits(63))
        if self.resampled:
            samples: Iterable = self._read(self._resampled(rng))
        else:
            samples = self._read(*self.share(self.epoch, worker, num_workers))
        if self.train and self.shuffle_buffer > 1:
            samples = wds.shuffle(self.shuffle_buffer, min(100, self.shuffle_buffer), rng=rng)(samples)
        samples = in_bursts(samples, BURST)
        batches = wds.batched(self.batch_size, collation_fn=self._collate,
                              partial=self.partial)(self._decode(samples))
        if self.batches_per_worker is not None:
            batches = islice(batches, self.batches_per_worker)
        yield from batches


class ShardLoader:
    """Iterable of batches `(images, labels)` (+ `keys` with `return_keys=True`) for one rank.

    `len(loader)` is exact with `resampled=True` (the same on every rank) and, without resampling, is
    this rank's batch count from the manifest's shard counts (unknown without a manifest). Each
    `iter()` is one epoch; the shard order changes with the epoch (`set_epoch` to choose it).
    """

    def __init__(self, dataset: ShardDataset, loader: DataLoader, *, num_workers: int,
                 batches_per_epoch: int | None, manifest: ShardManifest | None,
                 output: Output = Output.FLOAT32, device: torch.device | None = None,
                 image_shape: tuple[int, ...] | None = None, ring_slots: int = 0,
                 decoder: Callable | None = None) -> None:
        self.dataset, self._loader = dataset, loader
        self.decoder = decoder  # decode="gpu": EncodedBatch -> tensors on the device
        self.image_shape, self.ring_slots = image_shape, ring_slots
        self.output, self.device = output, device
        self.num_workers = num_workers
        self.batches_per_epoch = batches_per_epoch
        self.manifest = manifest
        self.epoch = 0

    @property
    def stats(self) -> LoaderStats:
        return self.dataset.stats

    @property
    def rank(self) -> int:
        return self.dataset.rank

    @property
    def world_size(self) -> int:
        return self.dataset.world_size

    @property
    def batch_size(self) -> int:
        return self.dataset.batch_size

    @property
    def classes(self) -> list[str] | None:
        return self.manifest.classes if self.manifest else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch
        ds = self.dataset
        if not all(u in ds.counts for u in ds.urls):
            raise TypeError("length unknown: these shards have no manifest with sample counts "
                            "(write them with write_shards, or pass resampled=True and epoch_size)")
        total = 0
        workers = max(1, self.num_workers)
        for w in range(workers):
            shards, stride, offset = ds.share(self.epoch, w, workers)
            n = len(range(offset, sum(ds.counts[u] for u in shards), stride))
            total += math.ceil(n / ds.batch_size) if ds.partial else n // ds.batch_size
        return total

    def __iter__(self):
        self.dataset.epoch = self.epoch  # workers start from a copy of the dataset as it is now
        self.epoch += 1
        # a fresh ring per epoch (per iterator), mapped before the workers fork; the batches of an
        # earlier epoch that the caller still holds keep theirs alive
        ring = self._new_ring()  # held by this generator for the epoch; the batches hold it too
        self.dataset.ring = ring
        try:
            workers = it = iter(self._loader)
        finally:
            self.dataset.ring = None  # the workers have their copy; nothing else needs it
        if self.batches_per_epoch is not None:
            # every rank stops after exactly the same number of batches (each worker yields a few
            # more than its share; the leftovers are dropped with the iterator)
            it = islice(it, self.batches_per_epoch)
        try:
            for batch in it:
                yield self._finish(batch)
        except Exception as exn:
            # a worker's error (a ShardError) comes with frames that hold the DataLoader iterator
            # in a reference cycle: freed only by the cycle collector, at some later moment, and
            # then it waits 5 s per worker to stop them. Dropped now, it stops them at once.
            traceback.clear_frames(exn.__traceback__)
            if isinstance(exn, RuntimeError) and str(exn).startswith("DataLoader timed out"):
                raise LoaderStallError(
                    f"no batch from the {self.num_workers} DataLoader workers of rank {self.rank} "
                    f"in {self._loader.timeout:g} s (shards in {Path(self.dataset.urls[0]).parent}):"
                    f" a worker is stuck, in a read that does not return (a network filesystem?) "
                    f"or since it started. Resume from the last checkpoint; "
                    f"shard_loader(timeout=...) sets this limit") from None
            raise
        finally:
            end_workers(workers)  # now; SIGKILL for a worker that does not stop when asked
            del it, workers

    def _new_ring(self) -> BatchRing | None:
        """Shared batch slots for this epoch's workers, when they will inherit them (fork)."""
        if self.num_workers == 0 or self.ring_slots < 1 or self.image_shape is None:
            return None
        # spawn/forkserver workers cannot inherit an anonymous mapping
        if self._loader.multiprocessing_context.get_start_method() != "fork":
            return None
        return BatchRing(self.num_workers, self.ring_slots, (self.batch_size, *self.image_shape))

    def _finish(self, batch):
        """A batch from a worker (a ring slot, or tensors) → on `device` (asynchronously from
        pinned memory), normalised there unless output="uint8"."""
        if isinstance(batch, RingBatch):
            batch = batch.materialize()
        elif isinstance(batch, gpu_decode.EncodedBatch):
            batch = self.decoder(batch)
        if self.device is None and self.output is Output.UINT8:
            return batch
        images, labels, *keys = batch
        if self.device is not None:
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
        if self.output is Output.FLOAT32:
            images = normalize_batch(images)
        return (images, labels, *keys)

    def __repr__(self) -> str:
        return (f"ShardLoader(shards={len(self.dataset.urls)}, rank={self.rank}/{self.world_size}, "
                f"workers={self.num_workers}, batch_size={self.batch_size}, "
                f"resampled={self.dataset.resampled}, batches_per_epoch={self.batches_per_epoch}, "
                f"output={str(self.output)!r}, device={str(self.device) if self.device else None!r})")


def dist_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): as given, else from RANK/WORLD_SIZE or torch.distributed, as webdataset
    finds them; (0, 1) in a single process."""
    if rank is None or world_size is None:
        r, w, _, _ = wds.utils.pytorch_worker_info()
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an int in [0, {world_size - 1}] (world_size={world_size})")
    return rank, world_size


def _default_pin_memory() -> bool:
    # Pinned (page-locked) host memory lets the copy to the GPU run asynchronously; it is useless
    # without a GPU. Decided through NVML / the launcher's env: torch.cuda.is_available() here could
    # initialise CUDA in a notebook kernel and break every later fork.
    from ..rank.accelerator import device_kind

    return device_kind() == "cuda"


def shard_loader(urls: str | list, batch_size: int, train: bool = True, image_size: int = 224,
                 augment: str = "basic", num_workers: int = 2, *, resampled: bool = False,
                 epoch_size: int | None = None, handler: str | Callable[[Exception], bool] = "raise",
                 shuffle_buffer: int = 1000, shard_shuffle: bool | None = None, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False,
                 pin_memory: bool | None = None, prefetch_factor: int = 2, output: str = "float32",
                 device: str | torch.device | None = None, return_keys: bool = False,
                 crop_scale: tuple[float, float] = CROP_SCALE,
                 multiprocessing_context: str | None = None, decode: str = "cpu",
                 timeout: float = 600.0) -> ShardLoader:
    """Batches from WebDataset shards for this rank (see the module docstring for the pipeline).

    urls: a shard directory (with write_shards' manifest, or any *.tar / *.tar.zst / *.tgz), a
        manifest path, a brace pattern (`dir/shard-{000000..000009}.tar`) or a list of paths.
    train: shuffle shards and samples and augment; False: fixed order, eval transform, and any
        number of shards (split by sample where there are fewer shards than readers).
    augment: "none" | "basic" (RandomResizedCrop + flip) | "autoaugment" (+ AutoAugment, RandomErasing).
    resampled, epoch_size: draw shards with replacement and give every rank exactly
        `epoch_size // (world_size * batch_size)` batches per epoch (`epoch_size` = samples per epoch
        over all ranks; default: the manifest's sample count). Use this for DDP training.
    handler: "raise" (default; ShardError names the shard), "warn" (log, skip, count in
        `loader.stats`) or a webdataset-style callable `(ShardError) -> bool`: True skips and
        counts, False ends this worker's stream, raising re-raises.
    rank, world_size: default from RANK/WORLD_SIZE or torch.distributed.
    pin_memory: default True only when the launch uses GPUs (decided without touching CUDA).
    num_workers: 0 decodes in the training process itself (for debugging: it competes with the
        model for the same cores, and torch's intra-op threads make small per-image ops slow).
    output: "float32" (default: normalised, in the training process, on `device`) or "uint8" (as
        decoded; normalise with `gpu_lab.data.normalize_batch`). Either way the workers hand over
        uint8 batches: a quarter of the bytes through shared memory, pinned memory and PCIe.
    device: where batches go before they are normalised, e.g. "cuda" or `accelerator.device`
        (copied asynchronously from pinned memory, normalised on the GPU); default: stay on the CPU.
    return_keys: batches are (images, labels, keys).
    decode: "cpu" (default: the workers decode), "gpu" (the workers hand over the encoded JPEG
        bytes and their crop/flip draws; the training process decodes each batch with nvJPEG on
        `device`, default the current CUDA device, and crops there: see `gpu_decode`), or "auto"
        (gpu when this host has one and `augment` is not "autoaugment"). "gpu" is refused on a
        host without a GPU.
    timeout: seconds to wait for the workers' next batch before failing with LoaderStallError (a
        read that never returns, a stuck worker); 0 waits forever. Ignored with num_workers=0.
    """
    out_kind, target = _checked_options(batch_size, num_workers, timeout, shuffle_buffer, augment,
                                        output, device)
    transform = build_transform(train, image_size, augment, crop_scale, normalize=False)
    on_device = gpu_decode.plan(decode, transform=transform, augment=augment, train=train,
                                device=target)
    handover, decoder, target = (None, None, target) if on_device is None else on_device
    policy = _policy(handler)
    rank, world_size = dist_info(rank, world_size)
    shards, manifest = resolve_shards(urls)
    if train and not resampled:
        _check_enough_shards(len(shards), world_size, num_workers)
    counts = _shard_counts(shards, manifest)
    batches_per_epoch, batches_per_worker = _epoch_batches(resampled, epoch_size, manifest,
                                                           world_size * batch_size, num_workers)
    workers = worker_options(multiprocessing_context)
    dataset = ShardDataset(
        shards, counts=counts, rank=rank, world_size=world_size,
        train=train, shard_shuffle=train if shard_shuffle is None else shard_shuffle,
        resampled=resampled, seed=seed, shuffle_buffer=shuffle_buffer,
        transform=transform, batch_size=batch_size, partial=not drop_last, handler=policy,
        stats=LoaderStats(workers["multiprocessing_context"]), return_keys=return_keys,
        batches_per_worker=batches_per_worker, handover=handover)
    loader = _worker_loader(dataset, num_workers, pin_memory, prefetch_factor, timeout, workers)
    return ShardLoader(dataset, loader, num_workers=num_workers, batches_per_epoch=batches_per_epoch,
                       manifest=manifest, output=out_kind, device=target,
                       image_shape=None if decoder else (3, image_size, image_size),
                       decoder=decoder,
                       # the batches a worker can have in flight, plus what the caller and the
                       # pin-memory thread hold; beyond that a worker falls back to a fresh segment
                       ring_slots=prefetch_factor + 3)


def _checked_options(batch_size, num_workers, timeout, shuffle_buffer, augment, output,
                     device) -> tuple[Output, torch.device | None]:
    """shard_loader's scalar options checked; returns (the output kind, the target device)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r}: expected an int >= 0")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout={timeout!r}: expected seconds >= 0 (0: wait forever)")
    if not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer={shuffle_buffer!r}: expected an int >= 0 (samples)")
    check_augment(augment)
    try:
        out_kind = Output(output)
    except ValueError:
        raise ValueError(f"output={output!r}: expected one of {Output.choices()}") from None
    try:
        return out_kind, None if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: expected None, a torch.device or a device string "
                         f"such as 'cpu', 'cuda' or 'cuda:1'") from None


def _check_enough_shards(n_shards: int, world_size: int, num_workers: int) -> None:
    """Training without resampling: every reader (rank x worker) needs a shard of its own."""
    readers = world_size * max(1, num_workers)
    if n_shards < readers:
        raise ValueError(
            f"{n_shards} shard(s) for {world_size} rank(s) x {max(1, num_workers)} worker(s) = "
            f"{readers} readers: every reader needs at least one shard, or it yields nothing (and "
            f"under DDP the other ranks hang waiting for it). Write at least {readers} shards "
            f"(write_shards(..., maxcount=<fewer samples per shard>)), use fewer workers, or pass "
            f"resampled=True with epoch_size.")


def _shard_counts(shards: list[str], manifest: ShardManifest | None) -> dict[str, int] | None:
    if manifest is None:
        return None
    by_name = manifest.counts()
    return {u: by_name[Path(u).name] for u in shards}


def _epoch_batches(resampled: bool, epoch_size: int | None, manifest: ShardManifest | None,
                   global_batch: int, num_workers: int) -> tuple[int | None, int | None]:
    """(batches per epoch per rank, per worker) of a resampled loader; (None, None) otherwise."""
    if not resampled:
        if epoch_size is not None:
            raise ValueError("epoch_size is only used with resampled=True (without resampling an "
                             "epoch is one pass over the shards)")
        return None, None
    if epoch_size is None:
        if manifest is None:
            raise ValueError("resampled=True needs epoch_size (samples per epoch over all ranks) "
                             "when the shards have no manifest")
        epoch_size = manifest.num_samples
    if not isinstance(epoch_size, int) or epoch_size < 1:
        raise ValueError(f"epoch_size={epoch_size!r}: expected a positive int (samples per epoch, "
                         f"all ranks together)")
    batches_per_epoch = max(1, epoch_size // global_batch)
    return batches_per_epoch, math.ceil(batches_per_epoch / max(1, num_workers))


def _worker_loader(dataset: ShardDataset, num_workers: int, pin_memory: bool | None,
                   prefetch_factor: int, timeout: float, workers: dict) -> DataLoader:
    kw: dict[str, Any] = {}
    if num_workers > 0:
        check_socket_room()
        # a Stop or a preemption is for the training process: it checkpoints, then ends them
        kw.update(prefetch_factor=prefetch_factor, timeout=float(timeout), **workers)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers,
                      pin_memory=_default_pin_memory() if pin_memory is None else pin_memory, **kw)
