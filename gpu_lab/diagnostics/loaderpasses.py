"""One pass of each thing the loader benchmark compares (`gpu_lab.diagnostics.loaderbench`,
`gpu-lab bench loader`): the naive path (ImageFolder + PIL, the baseline users start from), the
per-file loader on gpu_lab's decode path, the pipeline limit on one core and in parallel, and the
data-wait fraction of a small training loop. Each pass gives img/s and images per CPU-second.
bench/ reuses these passes for its own, longer measurements."""
from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ..data.shards import image_folder_files
from ..data.transforms import build_pil_transform, build_transform, decode, normalize_batch


class _FileBytes(Dataset):
    """One file per sample, gpu_lab's decode path: read → torchvision.io decode → v2 on uint8."""

    def __init__(self, files: list[tuple[Path, int]], transform: Callable) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        return self.transform(decode(path.read_bytes())), label


def _collate_u8(samples):
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def naive_loader(root: str | os.PathLike, batch_size: int, crop_size: int, augment: str,
                 num_workers: int) -> DataLoader:
    """The usual first attempt: ImageFolder + PIL + torchvision transforms, per file."""
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(root), transform=build_pil_transform(True, crop_size, augment))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=num_workers)


def per_file_loader(root: str | os.PathLike, batch_size: int, crop_size: int, augment: str,
                    num_workers: int) -> DataLoader:
    _, files = image_folder_files(root)
    ds = _FileBytes(files, build_transform(True, crop_size, augment, normalize=False))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                      collate_fn=_collate_u8)


@dataclass
class Pass:
    """One pass over a loader: steady-state img/s, and images per CPU-second of every process
    involved (this one and its worker processes): the second figure does not depend on what else
    runs on the machine."""

    rate: float
    images: int
    cpu_rate: float


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def throughput(loader: Iterable) -> Pass:
    """One pass. The wall clock runs from the arrival of the first batch to that of the last: the
    steady state, without the workers' start-up or their shutdown (a DataLoader joins its workers
    before it raises StopIteration, which the rate would otherwise charge to the loader). The CPU
    clock runs from iter() until the workers have been joined, start-up and shutdown included:
    that is CPU the loader costs."""
    cpu0 = _cpu_seconds()
    it = iter(loader)
    first = next(it)
    t0 = time.perf_counter()
    t_last, n = t0, 0
    for batch in it:
        t_last = time.perf_counter()
        n += len(batch[1])
    dt = t_last - t0
    del it  # shuts the workers down and joins them, so their CPU time is counted below
    gc.collect()
    cpu = _cpu_seconds() - cpu0
    total = n + len(first[1])
    return Pass(rate=n / dt if dt > 0 else float("inf"), images=total,
                cpu_rate=total / cpu if cpu > 0 else float("inf"))


def limit_batches(encoded: list[bytes], transform: Callable,
                  batch_size: int) -> Iterator[torch.Tensor]:
    """The pipeline limit's work: decode + `transform` on each of `encoded`, stacked `batch_size` at
    a time (uint8 batches, as the loader's workers make them)."""
    for i in range(0, len(encoded), batch_size):
        yield torch.stack([transform(decode(d)) for d in encoded[i:i + batch_size]])


def pipeline_limit(encoded: list[bytes], crop_size: int, augment: str, batch_size: int) -> Pass:
    """img/s of decode + transforms + batching (uint8, what the loader's workers do) in this process
    on one core (wall clock, and per CPU-second)."""
    tf = build_transform(True, crop_size, augment, normalize=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker runs single-threaded too
    try:
        for data in encoded[: min(32, len(encoded))]:  # warm-up
            tf(decode(data))
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in limit_batches(encoded, tf, batch_size):
            pass
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(threads)
    return Pass(rate=len(encoded) / dt, images=len(encoded), cpu_rate=len(encoded) / cpu)


def _limit_child(encoded: list[bytes], crop_size: int, augment: str, batch_size: int, go, results) -> None:
    go.wait()
    results.put(pipeline_limit(encoded, crop_size, augment, batch_size).rate)


def parallel_limit(encoded: list[bytes], crop_size: int, augment: str, batch_size: int,
                   processes: int) -> float:
    """img/s of `pipeline_limit` run in `processes` forked processes at once (summed): what the
    cores give together, with no reading and no inter-process transfer."""
    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_limit_child, args=(encoded, crop_size, augment, batch_size, go,
                                                     results), daemon=True) for _ in range(processes)]
    for proc in procs:
        proc.start()
    go.set()
    try:
        return sum(results.get(timeout=600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(60)


def limit_sample(files: list[Path], max_bytes: int = 1 << 30) -> list[Path]:
    """The images the pipeline limit decodes: all of the loader's images, unless their encoded bytes
    exceed `max_bytes` (then every k-th file, spread over the classes, within that).

    All of them rather than a smaller sample: a sample that fits in the CPU's last-level cache stays
    there from one limit pass to the next, while the loader streams every image through memory once
    per epoch, so a smaller sample makes the limit look faster than the loader's own work."""
    total = sum(p.stat().st_size for p in files)
    return files[::max(1, math.ceil(total / max_bytes))]


def naive_limit(files: list[Path], crop_size: int, augment: str, batch_size: int) -> Pass:
    """The same one-core measurement for the naive path: PIL open + decode, PIL transforms,
    ToTensor + Normalize per sample, stack (files on a warm page cache)."""
    from PIL import Image

    tf = build_pil_transform(True, crop_size, augment)

    def load(p: Path):
        with Image.open(p) as im:
            return tf(im.convert("RGB"))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in files[: min(32, len(files))]:
            load(p)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(files), batch_size):
            torch.stack([load(p) for p in files[i:i + batch_size]])
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(threads)
    return Pass(rate=len(files) / dt, images=len(files), cpu_rate=len(files) / cpu)


class _SmallCNN(torch.nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, num_classes))

    def forward(self, x):
        return self.net(x)


def data_wait_fraction(loader: Iterable, num_classes: int, steps: int) -> float:
    """Share of a training loop's wall time spent blocked in next(loader) (first step excluded).
    A uint8 batch is normalised inside the step, as the device would (it is not waiting)."""
    torch.manual_seed(0)
    model = _SmallCNN(num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    it = iter(loader)
    x, y = next(it)
    wait, t0, done = 0.0, time.perf_counter(), 0
    while done < steps:
        if x.dtype == torch.uint8:
            x = normalize_batch(x)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done += 1
        tw = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - tw
    total = time.perf_counter() - t0
    return wait / total if total > 0 else 0.0
