"""The shard loader against its pipeline limit, in instructions (valgrind's callgrind), not seconds.

bench/loader.py times the loader against its limit (the same decode + crop + flip + batching on
bytes already in memory, one core): on the shared development VM those timings drift by 10-15%
within seconds, so its ratio moves by several per cent between runs. Instructions executed do not
drift. This script counts them for one epoch over the same images, three ways, each in its own
process under callgrind:

- ``limit``: decode + transforms + torch.stack on the encoded bytes of the same images, in memory;
- ``in-process``: `shard_loader(num_workers=0)` over shards of those images: reading the tars,
  grouping members, shuffle buffer, decode + transforms, batching;
- ``worker``: the same loader with one DataLoader worker; the worker process is counted, from its
  fork to its exit (the DataLoader's loop, the batch hand-over, start-up and shut-down included).

It prints instructions per image and limit / loader. Instructions are not time (cache misses,
branch mispredictions and the host's drift are not in them), but the ratio repeats within about
0.002 (three runs on the development VM: limit / worker 0.969 each time), and it shows where the
loader's own work goes (per shared object: the decoder and torch's kernels against Python's
interpreter and libc). Needs valgrind (`apt-get install valgrind`); without it, it says so and
measures nothing. Takes about 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BATCH = 64
CROP = 128
TOOLS = ("valgrind", "callgrind_control", "callgrind_annotate")


def _ctl(*args: str) -> None:
    """callgrind_control on this process: switch instrumentation, dump the counts."""
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def child(mode: str, data_dir: str) -> None:
    """Runs under callgrind with instrumentation off; switches it on around one epoch over
    `data_dir`/shards (the limit: over the same images, read from `data_dir`/images)."""
    import torch

    from gpu_lab.data.loader import shard_loader
    from gpu_lab.diagnostics.loaderpasses import limit_batches
    from gpu_lab.data.shards import image_folder_files
    from gpu_lab.data.transforms import build_transform, decode

    torch.set_num_threads(1)  # as in a DataLoader worker
    torch.manual_seed(0)  # the same crops every run (a worker seeds itself from the loader's seed)
    encoded = [path.read_bytes() for path, _ in image_folder_files(Path(data_dir, "images"))[1]]
    tf = build_transform(True, CROP, "basic", normalize=False)
    for data in encoded[:BATCH]:  # the same warm-up for all three, as pipeline_limit does
        tf(decode(data))
    if mode == "limit":
        _ctl("-i", "on")
        for _ in limit_batches(encoded, tf, BATCH):
            pass
        images = len(encoded)
    else:
        loader = shard_loader(Path(data_dir, "shards"), BATCH, image_size=CROP,
                              num_workers=1 if mode == "worker" else 0, rank=0, world_size=1,
                              pin_memory=False, output="uint8")
        _ctl("-i", "on")  # a forked worker starts with it on, and writes its counts at its exit
        images = 0
        for batch in loader:
            images += len(batch[1])
            if mode == "worker" and images == len(batch[1]):
                _ctl("-i", "off")  # this process: only its worker is measured
    if mode != "worker":
        _ctl("-i", "off")
        _ctl("-d", mode)
    print(f"images {images}")


def by_object(path: Path) -> collections.Counter:
    """Instructions per shared object (basename) in a callgrind output file."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*?)(?: \[(.*)\])?$", line)
        if m and "PROGRAM TOTALS" not in line:
            counts[(m.group(3) or "?").rsplit("/", 1)[-1]] += int(m.group(1).replace(",", ""))
    return counts


def group(obj: str) -> str:
    if re.search(r"libjpeg|libpng|libwebp|^image.*\.so|libtorch_cpu|libc10", obj):
        return "decode + transforms"
    if obj.startswith("libpython"):
        return "Python interpreter"
    if obj.startswith(("libc.so", "ld-linux")):
        return "libc"
    return "other"


def run(mode: str, data_dir: Path, out_dir: Path) -> tuple[collections.Counter, int]:
    """(instructions per group, images) of `mode` under callgrind."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
           f"--callgrind-out-file={out_dir}/cg.{mode}.%p", sys.executable, __file__,
           "--child", mode, "--data", str(data_dir)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # the same dict and set orders every run
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"^images (\d+)$", proc.stdout, re.M)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{mode}: valgrind run failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    files = sorted(out_dir.glob(f"cg.{mode}.*"))
    if mode == "worker":  # the worker's own file: the one that is not the main process's
        main_pid = re.search(r"==(\d+)== Callgrind", proc.stderr)
        files = [f for f in files if main_pid and f.name.split(".")[2] != main_pid.group(1)]
    else:  # the dump made after the epoch (".1"); the file written at exit counts nothing
        files = [f for f in files if f.name.endswith(".1")]
    if len(files) != 1:
        raise SystemExit(f"{mode}: expected one callgrind output, found {[f.name for f in files]}")
    groups: collections.Counter = collections.Counter()
    for obj, n in by_object(files[0]).items():
        groups[group(obj)] += n
    return groups, int(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2560, help="images in the epoch (default 2560)")
    ap.add_argument("--child", choices=("limit", "in-process", "worker"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.data)
        return 0
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        print(f"not measured: {', '.join(missing)} not found (apt-get install valgrind)")
        return 0
    if args.images < BATCH:
        ap.error(f"--images={args.images}: expected at least one batch ({BATCH})")

    from gpu_lab.data.shards import write_shards
    from gpu_lab.data.synthetic import make_synthetic_images

    with tempfile.TemporaryDirectory(prefix="gpu_lab-instructions-") as tmp:
        work = Path(tmp)
        make_synthetic_images(work / "images", args.images, 160, 10, 0, progress=False)
        # 8 shards: the loader reads whole shards, as in bench/loader.py
        write_shards(work / "images", work / "shards", maxcount=-(-args.images // 8),
                     progress=False)
        modes = ("limit", "in-process", "worker")
        print(f"loader instructions: {args.images} synthetic 160 px JPEGs in 8 shards, "
              f"crop {CROP}, batch {BATCH}, augment=basic; callgrind, one epoch each "
              f"(about 3 minutes)", flush=True)
        with tempfile.TemporaryDirectory(dir=tmp) as out, ThreadPoolExecutor(len(modes)) as pool:
            # the three runs at once: instruction counts do not depend on what else runs
            results = dict(zip(modes, pool.map(lambda m: run(m, work, Path(out)), modes)))
    names = ("decode + transforms", "Python interpreter", "libc", "other")
    print(f"{'instructions per image':24s}" + "".join(f"{n:>22s}" for n in names)
          + f"{'total':>12s}")
    per_image = {}
    for mode, (groups, images) in results.items():
        per_image[mode] = sum(groups.values()) / images
        print(f"{mode:24s}" + "".join(f"{groups[n] / images:22,.0f}" for n in names)
              + f"{per_image[mode]:12,.0f}")
    for mode in ("in-process", "worker"):
        g, n = results[mode]
        lim_g, lim_n = results["limit"]
        work_ratio = (g["decode + transforms"] / n) / (lim_g["decode + transforms"] / lim_n)
        print(f"limit / {mode}: {per_image['limit'] / per_image[mode]:.3f} (instructions per "
              f"image; decode + transforms: {work_ratio:.4f} of the limit's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
