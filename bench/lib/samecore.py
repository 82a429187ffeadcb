"""The loader against its pipeline limit on the same cores at the same time: a ratio that the host's
speed swings do not move.

On a shared virtual machine a vCPU's speed drifts by 10-15% within seconds (other guests, the
host's hyperthread siblings; the hypervisor's "steal" does not show it). A loader pass and a limit
pass measured one after the other differ by that much before anything about the loader shows: the
benchmark's back-to-back (limit, loader, limit) pairs range 0.76-1.09 for the same code on the
development VM, so a median of 15 pairs still moves by about +-0.04 from run to run.

Here each of the loader's worker processes shares one core with a process that runs the pipeline
limit (decode + transforms + batching, on encoded bytes already in memory, as
`gpu_lab.diagnostics.loaderpasses.pipeline_limit` does). The kernel time-slices the two every few
milliseconds, so both run on the same machine at the same moments. Over whole passes of the loader, each one's images per CPU-second (all its
threads' time on a CPU, from /proc/<pid>/task/*/schedstat, in ns) give the ratio: what a worker
spends per image against what decode + transforms cost on their own. `calibrate` puts the
instrument on a known answer: two limit processes sharing a core read 1.00 (+-0.03 per window of
1,024 images on the development VM; the benchmark prints this check every run), and one of them
with 22 us of extra work per image (~5%) reads 0.95.

That ratio is about CPU cost. The loader's wall-clock rate is its images per CPU-second times the
share of the time its workers are on a CPU rather than waiting (for the training process to take a
batch, for the GIL): `WorkerClock` measures that share during ordinary passes, where each worker has
a core to itself. Their product estimates the loader / limit ratio of wall-clock rates without the
host's drift; it needs Linux (schedstat, CPU affinity) and a core for the process that takes the
batches besides one per worker. It is steady within a run (passes within about +-0.01); between
runs it moved (passes from 0.90 to 0.99 over a day on the development VM). Nor is it exact for two
different programs: a loop with the limit's work per image, written differently, read 0.94-1.05
against a limit process over one hour on that VM, while copies of the limit's own loop read
0.99-1.01 against it (sd 0.006 over 8 fresh processes), so `calibrate`, which runs two copies,
cannot see that bias. Instruction counts do not drift: bench/loader_instructions.py.

Two references sharpen it. The first pass waits until the limit processes have been once through
the images: a freshly forked limit process ran 3-5% slower per image through its first pass (its
first touch of each image's object copies an inherited page; 1,000 copy-on-write faults per 1,000
images, then none), so the first pass used to read 0.01-0.03 above the others. And the limit's own
loop also runs in DataLoader workers (`LimitInWorkers`), in turns with the loader, against the same
limit processes: 0.975-1.009 over the passes of two runs. A forked worker process costs that
code next to nothing, so what separates the loader from 1.00 is the loader's own work in its
worker. (The same loop handing two small tensors per batch through torch's shared memory read
0.93-0.94 in an ad hoc run: torch's per-tensor hand-over costs more than gpu_lab's whole pipeline
adds.)
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpu_lab.diagnostics.loaderpasses import limit_batches
from gpu_lab.data.transforms import build_transform, decode


def task_cpu_ns(pid: int, tid: int | None = None) -> int | None:
    """Nanoseconds on a CPU of thread `tid` of process `pid`, or of all its threads when `tid` is
    None (schedstat's first field); None when the process is gone or /proc has no schedstat."""
    pattern = f"/proc/{pid}/task/{'*' if tid is None else tid}/schedstat"
    files = glob.glob(pattern)
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            if tid is not None:
                return None  # the thread asked for is gone; a vanished sibling thread is not
    return total


def child_pids() -> set[int]:
    """The pids of this process's children (all of its threads' children), from /proc."""
    out: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def supported(num_workers: int) -> str | None:
    """Why the same-core measurement cannot run here (None when it can)."""
    if not hasattr(os, "sched_setaffinity"):
        return "no CPU affinity on this platform"
    if task_cpu_ns(os.getpid()) is None:
        return "no /proc/<pid>/task/*/schedstat (Linux with schedstats)"
    if num_workers < 1:
        return "it compares worker processes (num_workers >= 1)"
    cores = len(os.sched_getaffinity(0))
    if cores < num_workers + 1:
        return (f"{num_workers} worker(s) need {num_workers + 1} cores (one per worker, one for "
                f"the process that takes the batches); this process may use {cores}")
    return None


class WorkerClock:
    """CPU time of a loader's worker processes, read from the process that iterates the loader. The
    workers are the children of this process that did not exist when the clock was made, found at
    the first `find()` or `read()` (make the clock before the loader starts its workers, read it
    after the first batch)."""

    def __init__(self) -> None:
        self._before = child_pids()
        self.pids: list[int] = []

    def find(self) -> list[int]:
        if not self.pids:
            self.pids = sorted(child_pids() - self._before)
        return self.pids

    def read(self, all_threads: bool = False) -> int | None:
        """Total ns on a CPU of the workers' main threads (the ones that decode), or of all their
        threads; None when there are no workers (yet) or one has gone."""
        total = 0
        for pid in self.find() or [None]:
            ns = None if pid is None else task_cpu_ns(pid, None if all_threads else pid)
            if ns is None:
                return None
            total += ns
        return total


def _limit_loop(encoded: list[bytes], crop_size: int, augment: str, batch_size: int,
                counter: Any, core: int, extra_us: float = 0.0, tick: Any = None,
                tick_images: int = 0) -> None:
    """In a limit process: decode + transform + stack batches of `encoded` forever, pinned to
    `core`, counting every image in `counter` (one writer, no lock). For `calibrate`: `extra_us` of
    CPU spent after every image, and a message on `tick` (a pipe) every `tick_images` images."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)  # as in a DataLoader worker
    tf = build_transform(True, crop_size, augment, normalize=False)
    i, n = 0, len(encoded)
    while True:
        images = []
        for _ in range(batch_size):
            images.append(tf(decode(encoded[i])))
            i = (i + 1) % n
            if extra_us:
                until = time.thread_time() + extra_us / 1e6
                while time.thread_time() < until:
                    pass
            counter.value += 1
            if tick is not None and counter.value % tick_images == 0:
                tick.send(counter.value)
        torch.stack(images)


class LimitInWorkers(IterableDataset):
    """The limit's own loop (decode + transforms + stack, on encoded bytes in memory) run where the
    loader's work runs: in DataLoader worker processes, forked for the pass (worker k takes every
    num_workers-th image). Only the count of each batch crosses to the training process: what it
    measures against the limit is the worker process, not the loader's reading or hand-over. Its
    batches are (None, range(images)): `len(batch[1])` counts images, as for the loader."""

    def __init__(self, encoded: list[bytes], crop_size: int, augment: str, batch_size: int) -> None:
        super().__init__()
        self.encoded, self.crop_size, self.augment = encoded, crop_size, augment
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[tuple[None, range]]:
        info = get_worker_info()
        mine = self.encoded if info is None else self.encoded[info.id::info.num_workers]
        tf = build_transform(True, self.crop_size, self.augment, normalize=False)
        for batch in limit_batches(mine, tf, self.batch_size):
            yield None, range(len(batch))


def limit_in_workers(encoded: list[bytes], crop_size: int, augment: str, batch_size: int,
                     num_workers: int) -> DataLoader:
    """A loader over `LimitInWorkers` with `num_workers` worker processes."""
    return DataLoader(LimitInWorkers(encoded, crop_size, augment, batch_size), batch_size=None,
                      num_workers=num_workers)


def _pin_process(pid: int, core: int) -> None:
    for path in glob.glob(f"/proc/{pid}/task/*"):
        try:
            os.sched_setaffinity(int(path.rsplit("/", 1)[1]), {core})
        except (ProcessLookupError, FileNotFoundError):
            pass


@contextmanager
def _limit_processes(encoded: list[bytes], crop_size: int, augment: str, batch_size: int,
                     cores: list[int], **extra: Any) -> Iterator[list[tuple[Any, Any]]]:
    """One limit process per core in `cores`, as (process, image counter); killed on exit."""
    ctx = mp.get_context("fork")
    procs = []
    try:
        for core in cores:
            counter = ctx.RawValue("q", 0)
            proc = ctx.Process(target=_limit_loop, daemon=True, kwargs=extra,
                               args=(encoded, crop_size, augment, batch_size, counter, core))
            proc.start()
            procs.append((proc, counter))
        yield procs
    finally:
        for proc, _ in procs:
            proc.kill()
        for proc, _ in procs:
            proc.join()


def _limit_totals(limits: list[tuple[Any, Any]]) -> tuple[int, int] | None:
    """(images, ns on a CPU) of these limit processes together; None when one has gone."""
    cpu = [task_cpu_ns(proc.pid) for proc, _ in limits]
    if None in cpu:
        return None
    return sum(counter.value for _, counter in limits), sum(cpu)  # type: ignore[arg-type]


def _wait_for_images(limits: list[tuple[Any, Any]], receive: Any, images: int) -> None:
    """Until every limit process has counted `images` images (their ticks arrive on `receive`);
    raises RuntimeError when one dies first."""
    while min(counter.value for _, counter in limits) < images:
        if not receive.poll(5.0) and _limit_totals(limits) is None:
            raise RuntimeError("a limit process died")
        while receive.poll():
            receive.recv()


def same_core_passes(make_loaders: dict[str, Callable[[], Iterable]], num_workers: int,
                     encoded: list[bytes], crop_size: int, augment: str, batch_size: int, *,
                     passes: int = 4,
                     progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Loader / limit images per CPU-second over each of `passes` passes of every loader in
    `make_loaders` (name -> a function that makes it), the loaders in turns, from the arrival of a
    pass's first batch to that of its last (a whole pass: the shuffle buffer's first fill reads two
    samples per sample yielded, its last drain none), with worker k and limit process k on core k
    and this process on the cores left. The first pass starts once every limit process has gone
    through `encoded` once: a freshly forked process runs a few per cent slower until then (its
    first touch of each image's object copies a page inherited from this process: one
    copy-on-write fault per image; limit processes 1,000 images after their start read 0.94-0.97
    of older ones on the development VM, 1.00 after 10,000). Raises RuntimeError with the reason
    where `supported` has one."""
    why = supported(num_workers)
    if why is not None:
        raise RuntimeError(f"same-core measurement unavailable: {why}")
    own = os.sched_getaffinity(0)
    cores = sorted(own)
    worker_cores, rest = cores[:num_workers], set(cores[num_workers:])
    out: dict[str, list[float]] = {name: [] for name in make_loaders}
    receive, send = mp.get_context("fork").Pipe(duplex=False)
    try:
        os.sched_setaffinity(0, rest)  # the workers fork from here: they start on `rest` too
        with _limit_processes(encoded, crop_size, augment, batch_size, worker_cores, tick=send,
                              tick_images=len(encoded)) as limits:
            _wait_for_images(limits, receive, len(encoded))
            for name in [name for _ in range(passes) for name in make_loaders]:
                clock = WorkerClock()  # the limit processes are children already: not workers
                it = iter(make_loaders[name]())
                try:
                    next(it)
                except StopIteration:
                    raise RuntimeError(f"{name}: the loader yielded no batch") from None
                workers = clock.find()
                if len(workers) != num_workers:
                    raise RuntimeError(f"{name}: expected {num_workers} worker process(es), found "
                                       f"{len(workers)}: {workers}")
                for pid, core in zip(workers, worker_cores):
                    _pin_process(pid, core)

                def snapshot(images: int) -> tuple[int, ...] | None:
                    while receive.poll():  # the limits' ticks: never let the pipe fill up
                        receive.recv()
                    w, lim = clock.read(all_threads=True), _limit_totals(limits)
                    if w is None or lim is None:  # a worker has ended: the pass is over
                        return None
                    return images, w, *lim

                first = last = snapshot(0)
                images = 0
                for batch in it:  # a snapshot at every batch: the last one is taken while the
                    images += len(batch[1])  # workers still run (they end after the pass)
                    now = snapshot(images) if last is not None else None
                    last = now if now is not None else last
                del it  # the workers shut down
                if first is None or last is None or last[0] == 0:
                    raise RuntimeError(f"{name}: the loader's workers could not be followed "
                                       f"through /proc")
                d_img, d_wcpu, d_lim, d_lcpu = (b - a for a, b in zip(first, last))
                out[name].append((d_img / d_wcpu) / (d_lim / d_lcpu))
                if progress:
                    progress(f"same-core pass {len(out[name])}, {name}: images per CPU-second / "
                             f"the limit's = {out[name][-1]:.3f} ({d_img} images)")
    finally:
        os.sched_setaffinity(0, own)
        receive.close()
        send.close()
    return out


def calibrate(encoded: list[bytes], crop_size: int, augment: str, batch_size: int, *,
              extra_us: float = 0.0, windows: int = 6, window_images: int = 1024) -> list[float]:
    """The instrument on a known answer: two limit processes share one core, the second one
    spending `extra_us` more CPU per image; B / A images per CPU-second over `windows` windows of
    B's images. Expect 1.00 with no extra work, and t / (t + extra_us) for a limit that takes t us
    per image on a shared core."""
    why = supported(1)
    if why is not None:
        raise RuntimeError(f"same-core measurement unavailable: {why}")
    own = os.sched_getaffinity(0)
    cores = sorted(own)
    receive, send = mp.get_context("fork").Pipe(duplex=False)
    out: list[float] = []
    try:
        os.sched_setaffinity(0, set(cores[1:]))
        with _limit_processes(encoded, crop_size, augment, batch_size, cores[:1]) as (a,), \
                _limit_processes(encoded, crop_size, augment, batch_size, cores[:1],
                                 extra_us=extra_us, tick=send, tick_images=window_images) as (b,):
            def snapshot() -> tuple[int, ...]:
                totals = _limit_totals([a]), _limit_totals([b])
                if None in totals:
                    raise RuntimeError("a limit process died during the calibration")
                return (*totals[0], *totals[1])  # type: ignore[misc]

            _wait_for_images([b], receive, window_images)  # B's first window: both are warm
            start = snapshot()
            for k in range(windows):
                _wait_for_images([b], receive, window_images * (k + 2))
                end = snapshot()
                d_a, d_acpu, d_b, d_bcpu = (y - x for x, y in zip(start, end))
                out.append((d_b / d_bcpu) / (d_a / d_acpu))
                start = end
    finally:
        os.sched_setaffinity(0, own)
        receive.close()
        send.close()
    return out
