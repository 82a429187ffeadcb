"""Loader benchmark (issue #5): gpu_lab's shard loader vs the naive per-file PIL pipeline.

On 10,000 small synthetic JPEGs (160 px, made once in the temp dir and reused), at equal workers
and equal transforms, it prints img/s side by side, the pipeline limit, warm vs cold page cache,
the data-wait fraction of a training step, the shard writer's speed and the measured zstd ratio.
Workers: one per core, one core left to the process that takes the batches (1 on a 2-core machine;
the limit counts a core per worker); `--workers 2` there shows what the cores give with none left.
Each figure is the best of 2 rounds; the loader's ratio to its pipeline limit is the median of 22
back-to-back pairs, in a chain limit, loader, limit, ..., limit, each loader pass against the limit
passes either side (pairs during which the hypervisor stole more than 1% of the CPU time left out
when at least 3 and at least half of them remain; every pair is printed with its steal). Then 4
passes with the worker sharing a core with a limit process (gpu_lab.data.samecore): loader / limit
images per CPU-second without the host's second-to-second drift, and a calibration of that
instrument (two limit processes on one core: 1.00). Takes about 7 minutes on 2 cores. Extra
arguments go to `gpu-lab bench loader` (e.g. --workers 4).
"""
import sys

from gpu_lab.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "loader", "--n", "10000", "--repeats", "2", "--pairs", "22",
                   "--same-core", "4", *sys.argv[1:]]))
