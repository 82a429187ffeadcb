"""Batches for the fit loop: DataLoaders built from datasets, and (inputs, targets) from a batch.

fit() accepts a map-style Dataset (it then builds the DataLoader, so it can rebuild it with a
smaller batch after an OOM), an IterableDataset, a ready DataLoader (accelerate shards these over
the ranks), or a loader that already yields this rank's batches (`gpu_lab.data.shard_loader`: an
iterable with `set_epoch`, see `is_per_rank`), which fit uses as it is.
"""
from __future__ import annotations

import math
from typing import Any

from ..data.workers import check_socket_room, worker_options

IMAGE_KEYS = ("image", "images", "pixel_values", "input", "inputs", "x", "jpg", "png")
LABEL_KEYS = ("label", "labels", "target", "targets", "y", "cls")


def split_batch(batch: Any):
    """(inputs, targets) from a (x, y) tuple/list or a dict with an image and a label key."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        x = next((batch[k] for k in IMAGE_KEYS if k in batch), None)
        y = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if x is not None and y is not None:
            return x, y
        raise ValueError(f"batch: a dict with keys {sorted(batch)}; expected an image key (one of "
                         f"{', '.join(IMAGE_KEYS)}) and a label key (one of {', '.join(LABEL_KEYS)})")
    raise ValueError(f"batch: got {type(batch).__name__}; expected (inputs, targets) or a dict with "
                     "image and label keys")


def is_loader(data: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(data, DataLoader)


def is_per_rank(data: Any) -> bool:
    """A loader that already yields only this rank's batches (gpu_lab.data.ShardLoader, or any
    iterable with `set_epoch` that is neither a Dataset nor a DataLoader). accelerate must not
    shard it again."""
    from torch.utils.data import DataLoader, Dataset

    return (not isinstance(data, (Dataset, DataLoader)) and hasattr(data, "__iter__")
            and callable(getattr(data, "set_epoch", None)))


class SeededSamples:
    """A map-style dataset whose sample i makes its random draws (augmentation) from torch's RNG
    seeded by (seed, epoch, i), and leaves the caller's RNG as it found it.

    So the same image gets the same crop in a resumed run as in the original, whatever the workers
    do: accelerate reads one batch ahead, and a worker's RNG depends on when its iterator was
    made, so augmentation drawn from a running RNG stream cannot be resumed exactly."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        import torch

        g = torch.default_generator
        saved = g.get_state()  # a 5 kB copy: ~2 µs per sample with the seeding below
        g.manual_seed(hash((self.seed, self.epoch, int(index))) & 0x7FFF_FFFF_FFFF_FFFF)
        try:
            return self.dataset[index]
        finally:
            g.set_state(saved)

    def __getattr__(self, name: str) -> Any:  # classes, targets, ... of the wrapped dataset
        if name == "dataset":  # not set yet (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def make_loader(data: Any, batch_size: int, *, shuffle: bool, num_workers: int, seed: int,
                pin_memory: bool = False):
    """A DataLoader over `data` (returned unchanged if it already is one).

    The loader gets its own torch.Generator, so drawing the workers' base seed at each epoch never
    touches the global RNG that dropout uses, and a shuffled (training) dataset draws each sample's
    augmentation from a seed of its own (`SeededSamples`): a resumed run draws exactly what the
    original did.
    """
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    if is_loader(data) or is_per_rank(data):
        return data
    if isinstance(data, IterableDataset):
        shuffle = False  # an iterable pipeline shuffles itself (webdataset's shuffle stage)
    elif not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(f"train_data: got {type(data).__name__}; accepted: a torch Dataset, an "
                        "IterableDataset or a DataLoader")
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    if shuffle:
        data = SeededSamples(data, seed)
    kw: dict[str, Any] = {}
    if num_workers > 0:
        check_socket_room()
        # a Stop or a preemption is for the training process: it checkpoints, then ends them
        kw.update(persistent_workers=False, prefetch_factor=4, **worker_options())
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=False, generator=gen, **kw)


def micro_batches_per_epoch(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset without __len__
        return None


def steps_per_epoch(micro_batches: int | None, accum: int) -> int | None:
    """Optimizer steps per epoch: the last partial accumulation still steps (accelerate syncs at the
    end of the data loader)."""
    return None if micro_batches is None else math.ceil(micro_batches / accum)


__all__ = ["split_batch", "make_loader", "SeededSamples", "micro_batches_per_epoch",
           "steps_per_epoch", "is_loader", "is_per_rank"]
