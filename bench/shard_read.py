"""Plain tar shards read through a memory map (the loader before issue 22) against one readv per
member (now: a shard truncated under a worker is a ShardError, not SIGBUS), side by side in one run.

1. Reading alone, in this process: every member of the shards, microseconds per member. The
   mapped reader's figure includes the copy that decode() makes of each view (it copies nothing
   else); the readv reader's bytearrays go to the decoder as they are.
2. The loader: shard_loader with one worker on 160 px synthetic JPEGs (RandomResizedCrop to 128 +
   flip, batches of 64, uint8 out), once with each reader, in back-to-back pairs whose order
   alternates; the readv / mapped ratio of images per second is the median over the pairs, and of
   images per CPU-second (every process of the loader) too.

    python bench/shard_read.py [--n 4000] [--pairs 7]

The images are made once in the system temp dir (gpu_lab-bench-loader/) and reused; under a
minute on 2 cores.
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from gpu_lab.data import loader as loader_mod
from gpu_lab.data import make_synthetic_images, shard_loader, write_shards
from gpu_lab.diagnostics.loaderbench import throughput
from gpu_lab.data.tario import iter_buffer_members, iter_file_members, shard_members


@contextmanager
def mapped_members(url: str):
    """What shard_members did for a plain tar before: the file mapped, members as views of it."""
    with open(url, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    yield iter_buffer_members(mapped)


def read_mapped(urls: list[str]) -> int:
    n = 0
    for url in urls:
        with mapped_members(url) as members:
            for _, view in members:
                bytearray(view)  # the copy decode() made of a view
                n += 1
    return n


def read_readv(urls: list[str]) -> int:
    n = 0
    for url in urls:
        with open(url, "rb", buffering=0) as f:
            for _ in iter_file_members(f.fileno()):
                n += 1
    return n


def member_costs(urls: list[str], rounds: int = 9) -> dict[str, float]:
    costs: dict[str, list[float]] = {"mapped": [], "readv": []}
    fns = {"mapped": read_mapped, "readv": read_readv}
    for r in range(rounds):
        for name in (("mapped", "readv") if r % 2 else ("readv", "mapped")):
            t0 = time.perf_counter()
            n = fns[name](urls)
            costs[name].append((time.perf_counter() - t0) / n * 1e6)
    return {k: statistics.median(v) for k, v in costs.items()}


def loader_pass(shards: Path, reader: str):
    loader_mod.shard_members = mapped_members if reader == "mapped" else shard_members
    try:  # the workers fork after this point and inherit the reader
        loader = shard_loader(str(shards), 64, train=True, image_size=128, augment="basic",
                              num_workers=1, pin_memory=False, output="uint8")
        return throughput(loader)
    finally:
        loader_mod.shard_members = shard_members


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="images")
    ap.add_argument("--pairs", type=int, default=7, help="loader passes with each reader")
    args = ap.parse_args()
    work = Path(tempfile.gettempdir()) / "gpu_lab-bench-loader"
    images = work / f"images-{args.n}-160-10-0"
    if not (images / ".complete").exists():
        print(f"making {args.n} synthetic 160 px JPEGs in {images}")
        make_synthetic_images(images, args.n, 160, 10, 0)
        (images / ".complete").write_text("ok")
    with tempfile.TemporaryDirectory(prefix="shards-", dir=work) as tmp:
        report = write_shards(images, tmp, maxcount=max(1, args.n // 8), progress=False)
        urls = report.urls

        costs = member_costs(urls)
        print(f"reading alone, us per member (median of 9 alternated passes over "
              f"{2 * args.n} members): mapped + decode's copy {costs['mapped']:.2f}, "
              f"readv {costs['readv']:.2f} (+{costs['readv'] - costs['mapped']:.2f} us per "
              f"member, x{costs['readv'] / costs['mapped']:.2f})")

        loader_pass(Path(tmp), "readv")  # warm the page cache and the code
        rates, cpu_rates = [], []
        for i in range(args.pairs):
            order = ("mapped", "readv") if i % 2 == 0 else ("readv", "mapped")
            got = {name: loader_pass(Path(tmp), name) for name in order}
            rates.append(got["readv"].rate / got["mapped"].rate)
            cpu_rates.append(got["readv"].cpu_rate / got["mapped"].cpu_rate)
            print(f"pair {i + 1}: mapped {got['mapped'].rate:7.0f} img/s "
                  f"({got['mapped'].cpu_rate:5.0f}/CPU-s), readv {got['readv'].rate:7.0f} img/s "
                  f"({got['readv'].cpu_rate:5.0f}/CPU-s): {rates[-1]:.3f}")
        print(f"loader, readv / mapped (median of {args.pairs} pairs): img/s "
              f"{statistics.median(rates):.3f} (pairs {min(rates):.3f}-{max(rates):.3f}), "
              f"img per CPU-second {statistics.median(cpu_rates):.3f}")


if __name__ == "__main__":
    main()
