"""`gpu-lab` command line: one sub-command per job, each added by its own `_add_<name>` function.

To add a command: write `_add_<name>(subparsers)` that creates its parser, declares its
arguments and sets `func=<callable(args) -> int>`; then list it in `COMMANDS`. Benchmarks are
sub-commands of `bench` (`gpu-lab bench loader`): write `_add_bench_<name>(bench_subparsers)` and
list it in `BENCHES`. Heavy imports (torch, the package modules) go inside the `func`, so that
`gpu-lab --help` stays instant.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


# ------------------------------------------------------------------------------------- shards

def _add_shards(subparsers) -> None:
    p = subparsers.add_parser(
        "shards", help="write WebDataset shards from an ImageFolder tree",
        description="Write SRC (an ImageFolder tree: SRC/<class>/<image>) as WebDataset tar shards "
                    "(.jpg/.png + .cls) in OUT, with OUT/manifest.json (counts, classes, sizes, sha256).")
    p.add_argument("src", metavar="SRC", help="ImageFolder directory")
    p.add_argument("out", metavar="OUT", help="output directory (must hold no shards yet)")
    p.add_argument("--maxcount", type=int, default=10_000, help="samples per shard at most (default 10000)")
    p.add_argument("--maxsize", type=int, default=256 * 2**20,
                   help="uncompressed bytes per shard at most (default 256 MiB)")
    p.add_argument("--compress", choices=["none", "zstd"], default="none",
                   help="zstd: write .tar.zst and report the measured ratio")
    p.add_argument("--json", action="store_true", help="add <key>.json with the source path and class")
    p.add_argument("--no-shuffle", action="store_true", help="keep the folder order (one class per shard)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_shards)


def _run_shards(args: argparse.Namespace) -> int:
    from .data.shards import write_shards

    report = write_shards(args.src, args.out, maxcount=args.maxcount, maxsize=args.maxsize,
                          compress=None if args.compress == "none" else args.compress,
                          shuffle=not args.no_shuffle, seed=args.seed, include_json=args.json,
                          progress=not args.quiet)
    print(report.summary())
    return 0


# -------------------------------------------------------------------------------------- bench

def _add_bench(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print measured ratios",
                              description="Benchmarks that measure side by side in one run.")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH")
    for add in BENCHES:
        add(bench_sub)
    p.set_defaults(func=lambda args: _help(p))


def _add_bench_loader(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "loader", help="gpu_lab's shard loader vs the naive per-file PIL pipeline",
        description="img/s of gpu_lab's shard loader vs the per-file ImageFolder + PIL pipeline at "
                    "equal workers and transforms, the pipeline limit, warm vs cold page cache, the "
                    "data-wait fraction of a training step, and the zstd ratio.")
    add_bench_loader_arguments(p)
    p.set_defaults(func=_run_bench_loader)


def add_bench_loader_arguments(p: argparse.ArgumentParser) -> None:
    """The loader benchmark's flags (bench/loader.py adds its method's to them)."""
    p.add_argument("--data", help="ImageFolder to use (default: synthetic JPEGs made once in --work-dir)")
    p.add_argument("--n", type=int, default=10_000, help="synthetic images (default 10000)")
    p.add_argument("--image-size", type=int, default=160, help="synthetic image side, px (default 160)")
    p.add_argument("--crop-size", type=int, default=128, help="training crop side, px (default 128)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers for every loader (default: one per core, one core left to "
                        "the process that takes the batches, at most 4)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--augment", choices=["none", "basic", "autoaugment"], default="basic")
    p.add_argument("--work-dir", help="where synthetic images and shards go (default: temp dir)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache runs")
    p.add_argument("--steps", type=int, default=30, help="training steps for the data-wait fraction")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every measurement, best kept (default 1; more on a busy machine)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def bench_loader_kwargs(args: argparse.Namespace) -> dict:
    """`gpu_lab.diagnostics.loader_bench`'s arguments from the flags of `add_bench_loader_arguments`."""
    return dict(data_dir=args.data, n=args.n, image_size=args.image_size, crop_size=args.crop_size,
                num_workers=args.workers, batch_size=args.batch_size, augment=args.augment,
                work_dir=args.work_dir, cold=not args.no_cold, data_wait_steps=args.steps,
                repeats=args.repeats, progress=not args.json)


def _run_bench_loader(args: argparse.Namespace) -> int:
    import json

    from .diagnostics.loaderbench import loader_bench

    report = loader_bench(**bench_loader_kwargs(args))
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.table())
    return 0


# ------------------------------------------------------------------ doctor & diagnostics benches

def _add_doctor(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="environment report: GPUs, topology, CUDA/NCCL, host, variables, warnings",
        description="Report OS, Python, torch/CUDA/cuDNN/NCCL, the driver, GPUs and their NVLink/PCIe "
                    "topology (NVML), CPU/NUMA/RAM/disk, the variables that matter, and warn where a "
                    "value hurts (e.g. CUDA_LAUNCH_BLOCKING=1). Never initialises CUDA.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--path", action="append", default=[], help="a data directory whose disk matters "
                                                               "(repeatable)")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from .diagnostics.doctor import doctor

    rep = doctor(paths=args.path)
    print(rep.to_json() if args.json else rep)
    return 0


def _add_bench_allreduce(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "allreduce", help="all-reduce algbw/busbw over N ranks, like nccl-tests",
        description="Time an in-place all-reduce for each message size on N ranks launched through "
                    "gpu_lab.launch (gloo on CPUs, NCCL on GPUs); print size, time, algbw, busbw and "
                    "#wrong as nccl-tests' all_reduce_perf does.")
    p.add_argument("--sizes", default=None,
                   help="MIN:MAX stepped by --factor, or a comma list (default 8:256M; 8:1M with "
                        "GPU_LAB_QUICK=1)")
    p.add_argument("--factor", type=int, default=2, help="size step factor (default 2)")
    p.add_argument("-n", "--num-processes", type=int, default=None,
                   help="ranks (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size at most (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_bench_allreduce)


def _run_bench_allreduce(args: argparse.Namespace) -> int:
    import json

    from .diagnostics.allreduce import allreduce_bench, parse_sizes

    spec = args.sizes.split(",") if args.sizes and "," in args.sizes else args.sizes
    sizes = parse_sizes(spec, factor=args.factor)
    res = allreduce_bench(sizes, args.num_processes, iters=args.iters, warmup=args.warmup,
                          dtype=args.dtype)
    print(json.dumps(res.to_dict(), indent=1) if args.json else res.table() + "\n\n" + res.bars())
    return 0 if res.wrong == 0 else 1


def _add_bench_io(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "io", help="sequential/random read MB/s and IOPS of a data directory; live iostat",
        description="Read the files under DIR sequentially (4 MiB blocks) and at random (4 KiB), "
                    "cold from the page cache where the file system allows it; --watch then prints "
                    "iostat -x style disk rates.")
    p.add_argument("dir", metavar="DIR", help="data directory (or file)")
    p.add_argument("--max-mb", type=int, default=1024, help="read at most this many MiB (default 1024)")
    p.add_argument("--rand-reads", type=int, default=2000, help="random 4 KiB reads (default 2000)")
    p.add_argument("--write-test-mb", type=int, default=None,
                   help="benchmark a test file of this many MiB written into DIR (removed after)")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                   help="afterwards, print disk rates every second for SECONDS")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_bench_io)


def _run_bench_io(args: argparse.Namespace) -> int:
    import json
    import time

    from .diagnostics.iobench import DiskMonitor, io_bench

    res = io_bench(args.dir, max_mb=args.max_mb, rand_reads=args.rand_reads,
                   write_test_mb=args.write_test_mb)
    print(json.dumps(res.to_dict(), indent=1) if args.json else res)
    if args.watch > 0:
        with DiskMonitor(interval=1.0, on_sample=lambda s: print(DiskMonitor.format(s), flush=True)):
            time.sleep(args.watch)  # the monitor thread prints; this only waits for the user's span
    return 0


def _add_bench_gpu(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "gpu", help="ResNet-50 training img/s in fp32/TF32/bf16 (+compile), MFU, vs NVIDIA A100",
        description="Train on synthetic on-device tensors in each precision, with channels_last and "
                    "torch.compile; print img/s and MFU next to NVIDIA's A100 80GB figures (938 img/s "
                    "TF32, 2,470 img/s AMP). Without a GPU: a tiny-model CPU mode.")
    p.add_argument("--cpu", action="store_true", help="CPU mode even where a GPU exists")
    p.add_argument("--model", default=None, help="default resnet50 (GPU), tiny_resnet (CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default 256 (GPU), 32 (CPU)")
    p.add_argument("--image-size", type=int, default=None, help="default 224 (GPU), 32 (CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 30 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10 GPU, 2 CPU)")
    p.add_argument("--variants", default=None,
                   help="comma list of fp32, tf32, bf16, tf32+compile, bf16+compile, fp32+compile")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--no-channels-last", action="store_true", help="keep NCHW memory format")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_bench_gpu)


def _run_bench_gpu(args: argparse.Namespace) -> int:
    import json

    from .diagnostics.gpubench import gpu_benchmark

    res = gpu_benchmark(args.model, args.batch_size, args.image_size, args.steps, args.warmup,
                        variants=args.variants.split(",") if args.variants else None,
                        channels_last=not args.no_channels_last, cpu=True if args.cpu else None,
                        compile=not args.no_compile)
    print(json.dumps(res.to_dict(), indent=1) if args.json else res.table())
    return 0


# ------------------------------------------------------------------------------------- export

def _add_export(subparsers) -> None:
    from .export.cli import add_parser  # argparse only; exporters never import torch

    add_parser(subparsers)


# ----------------------------------------------------------------------------------- registry

def _add_registry(subparsers) -> None:
    p = subparsers.add_parser("registry", help="the run registry: check what of it is readable",
                              description="Commands about the run registry ($GPU_LAB_HOME/registry.db).")
    sub = p.add_subparsers(dest="registry_command", metavar="ACTION")
    check = sub.add_parser(
        "check", help="integrity check, runs and events per run; exit 1 when not healthy",
        description="Read the registry without changing it: SQLite's integrity_check, every run and "
                    "its number of events. Exit status 0 when healthy, 1 when not (damaged or "
                    "missing), with what to do.")
    check.add_argument("--path", help="the registry file (default: $GPU_LAB_HOME/registry.db)")
    check.set_defaults(func=_run_registry_check)
    p.set_defaults(func=lambda args: _help(p))


def _run_registry_check(args: argparse.Namespace) -> int:
    from .record.registry import check

    ok, lines = check(args.path)
    print("\n".join(lines))
    return 0 if ok else 1


# -------------------------------------------------------------------------------------- admin

def _add_admin(subparsers) -> None:
    p = subparsers.add_parser("admin", help="what an administrator does once for a shared host",
                              description="Commands for the host's administrator (as root).")
    sub = p.add_subparsers(dest="admin_command", metavar="ACTION")
    init = sub.add_parser(
        "init-host", help="make the host's queue folder, root's, where /tmp cleaners do not go",
        description="Make the folder in which every user's runs claim this host's GPUs and wait "
                    "their turn, owned by root and sticky (mode 1777), so that no user can "
                    "remove another's tickets or locks, outside /tmp so that no cleaner ages "
                    "them. Runs started afterwards use it (unless GPU_LAB_CLAIMS_DIR says "
                    "otherwise). Needs root.")
    init.add_argument("--path", help="the folder (default: /var/lib/gpu_lab/claims, where "
                                     "gpu_lab looks for it)")
    init.set_defaults(func=_run_admin_init_host)
    p.set_defaults(func=lambda args: _help(p))


def _run_admin_init_host(args: argparse.Namespace) -> int:
    from .supervise.claims import ADMIN_FOLDER, init_host, protection

    try:
        folder = init_host(args.path or ADMIN_FOLDER)
    except (PermissionError, RuntimeError) as e:
        print(f"gpu-lab admin init-host: {e}", file=sys.stderr)
        return 1
    print(protection(folder)["says"])
    if args.path and args.path != ADMIN_FOLDER:
        print(f"runs use it where GPU_LAB_CLAIMS_DIR={folder} is set in their environment")
    return 0


# --------------------------------------------------------------------------------------- main

COMMANDS: list[Callable] = [_add_shards, _add_bench, _add_doctor, _add_export, _add_registry,
                            _add_admin]
BENCHES: list[Callable] = [_add_bench_loader, _add_bench_allreduce, _add_bench_io, _add_bench_gpu]


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-lab", description="gpu_lab command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    parser.set_defaults(func=lambda args: _help(parser))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
