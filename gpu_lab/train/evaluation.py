"""Evaluation that counts every validation sample exactly once, over all ranks together.

Each rank evaluates its own share of the data to the end of that share and adds up correct
predictions, losses and samples; one all_reduce then sums the three over the ranks. No collective
runs per batch, so ranks whose shares differ by a batch (or by a whole shard) cannot hang, and
nothing is padded or drawn twice. (accelerate's prepared loaders instead repeat samples until every
rank has as many batches, and gather_for_metrics drops the repeats again: exact only when every
rank calls it once per batch, which uneven per-rank loaders cannot promise.)

The shares (`eval_batches`):
- a map-style Dataset, or a DataLoader over one: the loader's batches in the loader's order, batch
  i on rank i % world. The ranks must agree on that order: a RandomSampler or a
  SubsetRandomSampler is read in a fixed order instead (the metric does not depend on the order), a
  DistributedSampler (which pads the last ranks with repeated samples) is replaced, and samplers
  that draw with replacement are refused;
- an IterableDataset, or a DataLoader over one: every rank reads the whole stream and keeps its
  batches by the same rule (the stream must not split itself by rank; accelerate assumes the same);
- a per-rank loader (`gpu_lab.data.shard_loader`): already this rank's share of the shards or
  samples; a resampled one (shards drawn with replacement) is refused.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from .data import is_per_rank, make_loader, split_batch


def eval_batches(data: Any, *, rank: int, world: int, batch_size: int, num_workers: int,
                 seed: int, pin_memory: bool = False):
    """This rank's share of `data` as an iterable of batches (see the module docstring)."""
    if is_per_rank(data):
        if getattr(getattr(data, "dataset", None), "resampled", False):
            raise ValueError("eval_data: a resampled shard loader draws shards with replacement, so "
                             "some samples would count twice and others never; build the evaluation "
                             "loader with resampled=False (shard_loader's default)")
        return data
    loader = make_loader(data, batch_size, shuffle=False, num_workers=num_workers, seed=seed,
                         pin_memory=pin_memory)
    return RankShare(loader, rank, world)


class RankShare:
    """Batch i of `loader` on rank i % world: a map-style loader is rebuilt so that each rank only
    loads its own batches; an iterable one is read whole and thinned."""

    def __init__(self, loader, rank: int, world: int) -> None:
        from torch.utils.data import IterableDataset

        if not 0 <= rank < world:
            raise ValueError(f"rank={rank!r}: expected an int in [0, {world - 1}]")
        self.rank, self.world = rank, world
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.loader = loader if self.iterable else _strided(loader, rank, world)

    def __iter__(self) -> Iterator:
        if not self.iterable:
            yield from self.loader
            return
        for i, batch in enumerate(self.loader):
            if i % self.world == self.rank:
                yield batch

    def __len__(self) -> int:
        n = len(self.loader)  # TypeError for an iterable dataset without a length, as a loader does
        return n if not self.iterable else len(range(self.rank, n, self.world))


class _Strided:
    """Every `world`-th item of `inner` (a sampler or a batch sampler), from `rank` on."""

    def __init__(self, inner: Iterable, rank: int, world: int) -> None:
        self.inner, self.rank, self.world = inner, rank, world

    def __iter__(self) -> Iterator:
        for i, item in enumerate(self.inner):
            if i % self.world == self.rank:
                yield item

    def __len__(self) -> int:
        return len(range(self.rank, len(self.inner), self.world))


def _fixed_order(sampler):
    """`sampler` made to give the same order on every rank (or refused where it cannot)."""
    from torch.utils.data import (DistributedSampler, RandomSampler, SequentialSampler,
                                  SubsetRandomSampler, WeightedRandomSampler)

    if isinstance(sampler, DistributedSampler):
        return SequentialSampler(sampler.dataset)  # fit splits by rank itself, without padding
    if isinstance(sampler, RandomSampler):
        n = len(sampler.data_source)
        if sampler.replacement or sampler.num_samples != n:
            raise ValueError(f"eval_data: the DataLoader's RandomSampler draws {sampler.num_samples} "
                             f"of {n} samples{' with replacement' if sampler.replacement else ''}; "
                             f"evaluation reads every sample once: use shuffle=False")
        return SequentialSampler(sampler.data_source)
    if isinstance(sampler, SubsetRandomSampler):
        return list(sampler.indices)
    if isinstance(sampler, WeightedRandomSampler):
        raise ValueError("eval_data: the DataLoader's WeightedRandomSampler draws samples at random "
                         "(with replacement by default); evaluation reads every sample once: use a "
                         "plain DataLoader (shuffle=False)")
    return sampler


def _strided(loader, rank: int, world: int):
    """A copy of map-style `loader` that loads only rank `rank`'s batches (on one rank: `loader`
    itself, once its sampler passed the same checks)."""
    from torch.utils.data import BatchSampler, DataLoader

    if world == 1:
        batches = loader.batch_sampler
        _fixed_order(loader.sampler if batches is None else getattr(batches, "sampler", None))
        return loader
    kw: dict[str, Any] = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                              pin_memory=loader.pin_memory, timeout=loader.timeout,
                              worker_init_fn=loader.worker_init_fn,
                              multiprocessing_context=loader.multiprocessing_context,
                              generator=loader.generator,
                              persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    batches = loader.batch_sampler
    if batches is None:  # batch_size=None: every item of the sampler is one sample, uncollated
        return DataLoader(loader.dataset, batch_size=None,
                          sampler=_Strided(_fixed_order(loader.sampler), rank, world), **kw)
    if type(batches) is BatchSampler:
        batches = BatchSampler(_fixed_order(batches.sampler), batches.batch_size, batches.drop_last)
    return DataLoader(loader.dataset, batch_sampler=_Strided(batches, rank, world), **kw)


def evaluate(model, batches: Iterable, loss_fn: Callable | None, *, device, world: int,
             channels_last: bool = False) -> dict[str, float | int]:
    """Accuracy, mean loss and the number of samples over every rank's `batches` together.

    Call it on every rank. `model` is the module itself, not its DDP wrapper: DDP's forward may
    broadcast buffers (a collective), which a rank with fewer batches would never join. Rank 0's
    buffers (BatchNorm statistics) are broadcast first, so every rank evaluates the same model.
    `loss_fn` None: per-sample cross-entropy; else its value (a batch mean, or one value per
    sample) counts for every sample of the batch. With no samples at all, only eval_samples (0).
    """
    import torch
    import torch.nn.functional as F
    from accelerate.utils import send_to_device

    if world > 1:
        import torch.distributed as dist

        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    total = 0
    with torch.no_grad():
        for batch in batches:
            x, y = split_batch(send_to_device(batch, device, non_blocking=True))
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            out = model(x)
            # kept on the device: no CPU-GPU sync per batch
            if loss_fn is None:
                loss_sum += F.cross_entropy(out.float(), y, reduction="sum")
            else:
                loss_sum += loss_fn(out, y).detach().float().expand(len(y)).sum()
            correct += (out.argmax(-1) == y).sum()
            total += len(y)
    sums = torch.stack([correct.double(), torch.tensor(float(total), dtype=torch.float64,
                                                       device=device), loss_sum])
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)  # the one collective: after every rank's last batch
    n_correct, n, loss = sums.tolist()
    n = int(n)
    if n == 0:
        return {"eval_samples": 0}
    return {"accuracy": n_correct / n, "eval_loss": loss / n, "eval_samples": n}


__all__ = ["eval_batches", "evaluate", "RankShare"]
