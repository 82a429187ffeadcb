"""Handing uint8 batches from DataLoader workers to the training process through reused shared memory.

torch's DataLoader gives every batch a fresh shared-memory segment: the worker creates it
(shm_open + ftruncate + mmap), faults in and zeroes every page as it writes the batch, registers the
file descriptor with a resource-sharer thread; the training process connects to that thread (a
socket and an HMAC handshake per tensor) to receive the descriptor, maps the segment, and unmaps it
when the batch dies. For a 3 MB batch of small images that is about a quarter of what decoding and
cropping the 64 images costs, spread over both processes and the kernel.

`BatchRing` maps a fixed set of batch-sized slots once, *before* the workers fork, so every worker
shares the mapping with the training process and nothing but a slot number crosses the pipe:

- a worker takes one of its own free slots (a flag byte per slot), stacks the batch into it and
  returns a `RingBatch` (slot number, labels, keys): a few hundred bytes of pickle;
- the training process turns it into a tensor over the slot (`RingBatch.materialize`, also done by
  the DataLoader's pin-memory thread), whose storage keeps a numpy view of the slot alive; when the
  last tensor or view over that storage dies, a finalizer clears the flag and the worker may reuse
  the slot. A batch is never overwritten while anything can still read it.
- a worker that finds none of its slots free (the user holds on to batches, or a spawn/forkserver
  context that cannot inherit the mapping) falls back to torch's fresh segment per batch.

The mapping is anonymous shared memory: it does not use /dev/shm, so the container default of 64 MB
there does not limit it. It lives until the iterator and every batch over it are gone.
"""
from __future__ import annotations

import itertools
import math
import mmap
import weakref
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_PAGE = mmap.PAGESIZE
_RINGS: "weakref.WeakValueDictionary[int, BatchRing]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class BatchRing:
    """`slots_per_worker` batch slots of `slot_shape` uint8 for each of `num_workers` workers, in one
    anonymous shared mapping. Create it in the training process before the workers fork."""

    def __init__(self, num_workers: int, slots_per_worker: int, slot_shape: tuple[int, ...]) -> None:
        if num_workers < 1 or slots_per_worker < 1:
            raise ValueError(f"num_workers={num_workers}, slots_per_worker={slots_per_worker}: "
                             f"expected positive ints")
        self.num_workers, self.slots_per_worker = num_workers, slots_per_worker
        self.slot_shape = tuple(slot_shape)
        self.num_slots = num_workers * slots_per_worker
        self.slot_bytes = _round_up(math.prod(self.slot_shape), _PAGE)
        self._header = _round_up(self.num_slots, _PAGE)
        self._mm = mmap.mmap(-1, self._header + self.num_slots * self.slot_bytes)  # MAP_SHARED
        self._flags = np.frombuffer(self._mm, dtype=np.uint8, count=self.num_slots)  # 1: in use
        self._worker_views: dict[int, torch.Tensor] = {}  # in a worker: one tensor per own slot
        self.id = next(_IDS)
        _RINGS[self.id] = self

    # ------------------------------------------------------------------ in a worker process
    def acquire(self, worker: int) -> int | None:
        """A free slot of `worker`, now marked in use; None when all of its slots are taken."""
        first = worker * self.slots_per_worker
        for slot in range(first, first + self.slots_per_worker):
            if self._flags[slot] == 0:
                self._flags[slot] = 1
                return slot
        return None

    def slot_tensor(self, slot: int, n: int) -> torch.Tensor:
        """The first `n` images of `slot`, as a writable uint8 tensor over the shared mapping."""
        view = self._worker_views.get(slot)
        if view is None:
            view = torch.frombuffer(self._mm, dtype=torch.uint8, count=math.prod(self.slot_shape),
                                    offset=self._offset(slot)).view(self.slot_shape)
            self._worker_views[slot] = view
        return view[:n]

    # ------------------------------------------------------------------ in the training process
    def take(self, slot: int, n: int) -> torch.Tensor:
        """The batch in `slot` as a tensor; the slot is released when its storage dies."""
        count = n * math.prod(self.slot_shape[1:])
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=count, offset=self._offset(slot))
        weakref.finalize(arr, self._release, slot)
        return torch.from_numpy(arr).view(n, *self.slot_shape[1:])

    def _release(self, slot: int) -> None:
        self._flags[slot] = 0

    def in_use(self) -> int:
        """Slots taken by workers and not yet released (batches in flight or still referenced)."""
        return int(self._flags.sum())

    def _offset(self, slot: int) -> int:
        return self._header + slot * self.slot_bytes

    def __repr__(self) -> str:
        return (f"BatchRing(id={self.id}, workers={self.num_workers}, slots_per_worker="
                f"{self.slots_per_worker}, slot_shape={self.slot_shape}, in_use={self.in_use()})")


@dataclass
class RingBatch:
    """What a worker returns for a batch stacked into a ring slot: pickles to a few hundred bytes."""

    ring_id: int
    slot: int
    n: int
    labels: bytes  # int64, native byte order
    keys: list[str] | None = None

    @staticmethod
    def labels_bytes(labels: list[int]) -> bytes:
        return array("q", labels).tobytes()

    def materialize(self) -> tuple[Any, ...]:
        """(images, labels[, keys]) as tensors; the images are a view of the slot (no copy)."""
        ring = _RINGS.get(self.ring_id)
        if ring is None:
            raise RuntimeError(f"batch ring {self.ring_id} is gone: a RingBatch can only be "
                               f"materialized in the process that created the ring, while it lives")
        images = ring.take(self.slot, self.n)
        labels = torch.frombuffer(bytearray(self.labels), dtype=torch.int64)
        return (images, labels) if self.keys is None else (images, labels, self.keys)

    def pin_memory(self, device: Any = None) -> tuple[Any, ...]:
        """Called by the DataLoader's pin-memory thread: pinned copies; the slot is released as soon
        as the copy is made."""
        images, labels, *keys = self.materialize()
        return (images.pin_memory(), labels.pin_memory(), *keys)
