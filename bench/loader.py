"""Loader benchmark (issue #5): gpu_lab's shard loader vs the naive per-file PIL pipeline.

On 10,000 small synthetic JPEGs (160 px, made once in the temp dir and reused), at equal workers
and equal transforms, it prints img/s side by side, the pipeline limit, warm vs cold page cache,
the data-wait fraction of a training step, the shard writer's speed and the measured zstd ratios:
what `gpu-lab bench loader` prints, with the method of `bench.lib.loader_method` on top.
Workers: one per core, one core left to the process that takes the batches (1 on a 2-core machine;
the limit counts a core per worker); `--workers 2` there shows what the cores give with none left.
Each figure is the best of 2 rounds; the loader's ratio to its pipeline limit is the median of 22
back-to-back pairs, in a chain limit, loader, limit, ..., limit, each loader pass against the limit
passes either side (pairs during which the hypervisor stole more than 1% of the CPU time left out
when at least 3 and at least half of them remain; every pair is printed with its steal). Then 4
passes with the worker sharing a core with a limit process (bench.lib.samecore): loader / limit
images per CPU-second without the host's second-to-second drift, and a calibration of that
instrument (two limit processes on one core: 1.00). Takes about 7 minutes on 2 cores. Takes the
flags of `gpu-lab bench loader` (e.g. --workers 4), and --pairs and --same-core.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.lib

from bench.lib import loader_method  # noqa: E402
from gpu_lab.cli import add_bench_loader_arguments, bench_loader_kwargs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_loader_arguments(p)
    p.add_argument("--pairs", type=int, default=22,
                   help="loader passes in a chain limit, loader, limit, ..., limit, each against "
                        "the limit passes either side; the loader / limit ratio is their median "
                        "(default 22)")
    p.add_argument("--same-core", type=int, default=4, metavar="PASSES",
                   help="loader passes with each worker sharing a core with a limit process: the "
                        "loader / limit ratio without the host's speed drift (default 4; 0 skips)")
    p.set_defaults(repeats=2)
    args = p.parse_args(argv)
    report = loader_method.run(**bench_loader_kwargs(args), limit_pairs=args.pairs,
                               same_core_passes=args.same_core)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
