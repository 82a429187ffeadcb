"""Loader benchmark: is the loader or the model the bottleneck, and what do shards buy?

Everything is measured side by side in one run, on the same images, with the same number of
workers and the same augmentation operations (RandomResizedCrop + flip, or + AutoAugment):

- ``naive``: the usual first attempt: torchvision ImageFolder, one file per sample, PIL decode,
  classic PIL transforms, ToTensor + Normalize per sample, DataLoader(shuffle=True).
- ``per_file``: one file per sample again, but gpu_lab's decode path (torchvision.io on uint8
  tensors, uint8 batches): isolates the storage layout from the decode path.
- ``shards``: `shard_loader` on shards written by `write_shards`, as a GPU job runs it: the workers
  hand over uint8 batches and the normalisation runs on the GPU after the copy (`device=`), so it
  is not the loader's work; ``shards_f32`` (warm) normalises on this CPU instead, in the process
  that consumes the batches, which is what a CPU-only job pays.
- ``limit``: the same decode + transforms (and batching) in this process on one core, on the
  encoded bytes of the same images already in memory (`limit_sample`), times the number of
  workers: what the loader could reach if reading and inter-process transfer were free. It counts
  a core per worker, so the default number of workers leaves one core to the process that
  consumes the batches (`default_workers`).
- ``parallel limit``: the same in-memory pipeline in as many processes as workers, all at once:
  what the cores deliver together (shared caches and memory bandwidth make it less than the
  one-core figure times the workers), the ceiling a loader can actually approach.
- warm and cold page cache (files evicted with posix_fadvise(DONTNEED) before each cold run; the
  report says how much stayed resident);
- the data-wait fraction of a training step: the share of wall time a small CNN's training loop
  spends blocked on `next(loader)`.

Throughput is steady-state: the clock runs from the arrival of the first batch to that of the last
(worker start-up, the shuffle buffer's first fill and the workers' shutdown are excluded for every
loader alike). Each figure is also given per CPU-second (all processes of the loader, start-up
included): on a shared machine, where other jobs take cores away, wall-clock img/s says more about
the neighbours than about the loader, while images per CPU-second stays comparable. Each figure is
the best of its rounds. `LoaderBench` holds the stages, for scripts that measure more between them.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..data import pagecache
from .loaderpasses import (Pass, data_wait_fraction, limit_sample, naive_limit, naive_loader,
                           parallel_limit, per_file_loader, pipeline_limit, throughput)
from ..data.shards import image_folder_files, write_shards
from ..data.synthetic import make_synthetic_images


def default_workers() -> int:
    """DataLoader workers for the benchmark: one per core this process may use, but one left to the
    process that consumes the batches (the training loop drives the GPU from it), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores - 1))


@dataclass
class BenchReport:
    """Measured numbers and their ratios. `rates`: steady-state img/s (wall clock);
    `cpu_rates`: images per CPU-second of all the processes a loader used (contention-proof)."""

    n_images: int
    source_size: int | None
    crop_size: int
    num_workers: int
    batch_size: int
    augment: str
    rates: dict[str, float] = field(default_factory=dict)
    cpu_rates: dict[str, float] = field(default_factory=dict)
    data_wait: dict[str, float] = field(default_factory=dict)  # fraction of step time
    cold_resident: dict[str, float] = field(default_factory=dict)  # page-cache share after evict
    limit_one_core: float = 0.0
    parallel_limit: float = 0.0  # img/s of the pipeline in num_workers processes at once
    naive_limit_one_core: float = 0.0
    writer_images_per_minute: float = 0.0
    num_shards: int = 0
    zstd_ratio: float | None = None  # whole shard files, tar headers and padding included
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    load_average: list[float] = field(default_factory=list)  # 1-min load before, after

    @staticmethod
    def _ratios(r: dict[str, float]) -> dict[str, float]:
        out = {}
        if "shards_warm" in r:
            if "naive_warm" in r:
                out["shards_vs_naive"] = r["shards_warm"] / r["naive_warm"]
            if "limit" in r:
                out["shards_vs_limit"] = r["shards_warm"] / r["limit"]
            if "per_file_warm" in r:
                out["shards_vs_per_file_warm"] = r["shards_warm"] / r["per_file_warm"]
        if "shards_cold" in r and "per_file_cold" in r:
            out["shards_vs_per_file_cold"] = r["shards_cold"] / r["per_file_cold"]
        return out

    @property
    def ratios(self) -> dict[str, float]:
        """Ratios of wall-clock img/s."""
        out = self._ratios(self.rates)
        if self.parallel_limit and "shards_warm" in self.rates:
            out["shards_vs_parallel_limit"] = self.rates["shards_warm"] / self.parallel_limit
        return out

    @property
    def cpu_ratios(self) -> dict[str, float]:
        """The same ratios on images per CPU-second; there the limit is one core's rate, the most
        images a CPU-second can give whatever the number of workers."""
        return self._ratios(self.cpu_rates)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"], d["cpu_ratios"] = self.ratios, self.cpu_ratios
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchReport":
        return cls(**{k: v for k, v in d.items() if k not in ("ratios", "cpu_ratios")})

    def table(self) -> str:
        return "\n".join([*self._figure_lines(), *self._ratio_lines(), *self._closing_lines()])

    def _figure_lines(self) -> list[str]:
        """The heading and one line per measured rate."""
        lines = [f"loader benchmark: {self.n_images} images ({self.source_size or '?'} px source), "
                 f"crop {self.crop_size}, augment={self.augment}, {self.num_workers} workers, "
                 f"batch {self.batch_size}, {self.cpu_count} CPU cores, load average "
                 + " -> ".join(f"{x:.1f}" for x in self.load_average),
                 f"{'measurement':36s} {'img/s':>8s} {'img/CPU-s':>10s}"]
        labels = {"naive_warm": "naive per-file PIL (warm)",
                  "per_file_warm": "per-file, gpu_lab decode (warm)",
                  "per_file_cold": "per-file, gpu_lab decode (cold)",
                  "shards_warm": "gpu_lab shard_loader (warm)",
                  "shards_cold": "gpu_lab shard_loader (cold)",
                  "shards_f32_warm": "shard_loader, normalised on CPU (warm)",
                  "limit": f"pipeline limit (1 core x {self.num_workers})"}
        for k, label in labels.items():
            if k in self.rates:
                cpu = self.cpu_rates.get(k)
                lines.append(f"{label:36s} {self.rates[k]:8.0f} {cpu:10.0f}" if cpu else
                             f"{label:36s} {self.rates[k]:8.0f}")
        if self.parallel_limit:
            lines.append(f"{f'pipeline in {self.num_workers} processes at once':36s} "
                         f"{self.parallel_limit:8.0f}")
        if self.naive_limit_one_core:
            lines.append(f"{'naive path on one core':36s} {self.naive_limit_one_core:8.0f} "
                         f"{self.cpu_rates.get('naive_limit', 0):10.0f}")
        return lines

    def _ratio_lines(self, targets: dict[str, float] | None = None) -> list[str]:
        """One line per ratio, wall clock and per CPU-second; with `targets`, each one's verdict."""
        lines = ["ratios: wall clock" + (" (target)" if targets else "") + " | per CPU-second"]
        cpu_r = self.cpu_ratios
        for k, v in self.ratios.items():
            t = (targets or {}).get(k)
            verdict = "" if t is None else f"(>= {t:g}: {'met' if v >= t else 'MISSED'})"
            c = f"| {cpu_r[k]:.2f}x" if k in cpu_r else ""
            lines.append(f"  {k:26s} {v:6.2f}x {verdict:18s} {c}")
        return lines

    def _closing_lines(self) -> list[str]:
        """Data wait, page cache, the shard writer and zstd."""
        lines = [f"data-wait fraction of a training step, {k}: {v:.0%}"
                 for k, v in self.data_wait.items()]
        lines += [f"page cache after eviction, {k}: {v:.0%} resident"
                  for k, v in self.cold_resident.items()]
        lines.append(f"shard writer: {self.writer_images_per_minute:,.0f} images/min, {self.num_shards} shards")
        if self.zstd_ratio is not None:
            lines.append(f"zstd: shard files {self.zstd_ratio:.3f}:1 (tar padding included)")
        return lines

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rates={ {k: round(v) for k, v in self.rates.items()} })"


# ------------------------------------------------------------------------------- the benchmark

class LoaderBench:
    """The benchmark's stages on one set of images and shards (see the module docstring):

        with LoaderBench(data_dir, num_workers=2) as b:
            b.rounds(repeats=2)           # every loader warm and cold, the limits
            ...                           # more passes: b.loader(), b.limit(), b.record()
            report = b.finish(data_wait_steps=30)

    data_dir: an ImageFolder tree to use; default: `n` synthetic `image_size` px JPEGs, made once in
        `work_dir` (default: a `gpu_lab-bench-loader` folder in the system temp dir) and reused.
    num_workers: for every loader; default `default_workers()` (a core left to this process).
    The shards are written on entering and removed on leaving.
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, *, n: int = 10_000,
                 image_size: int = 160, crop_size: int = 128, num_classes: int = 10,
                 num_workers: int | None = None, batch_size: int = 64, augment: str = "basic",
                 work_dir: str | os.PathLike | None = None, shards_per_worker: int = 8,
                 seed: int = 0, progress: bool = True) -> None:
        self.num_workers = default_workers() if num_workers is None else num_workers
        self.work = Path(work_dir) if work_dir else Path(tempfile.gettempdir()) / "gpu_lab-bench-loader"
        self.crop_size, self.batch_size, self.augment, self.seed = crop_size, batch_size, augment, seed
        self.progress = progress
        self._make = (data_dir, n, image_size, num_classes, shards_per_worker)
        self._dirs: list[Path] = []

    def log(self, msg: str) -> None:
        if self.progress:
            print(f"[bench loader] {msg}", flush=True)

    def __enter__(self) -> "LoaderBench":
        try:
            self._prepare()
        except BaseException:
            self._remove()
            raise
        return self

    def _prepare(self) -> None:
        data_dir, n, image_size, num_classes, shards_per_worker = self._make
        self.work.mkdir(parents=True, exist_ok=True)
        source_size: int | None = image_size
        if data_dir is None:
            data_dir = self.work / f"images-{n}-{image_size}-{num_classes}-{self.seed}"
            stamp = data_dir / ".complete"
            if not stamp.exists():
                self.log(f"making {n} synthetic {image_size} px JPEGs in {data_dir}")
                make_synthetic_images(data_dir, n, image_size, num_classes, self.seed,
                                      progress=self.progress)
                stamp.write_text("ok")
        else:
            source_size = None
        self.data_dir = Path(data_dir)
        self.classes, files = image_folder_files(self.data_dir)
        self.files = [p for p, _ in files]
        # shards: enough for every worker to have several, so the last ones do not run alone
        maxcount = max(1, math.ceil(len(files) / (max(1, self.num_workers) * shards_per_worker)))
        self.shard_dir = self._tempdir("shards-")
        self.log(f"writing shards ({maxcount} samples each) to {self.shard_dir}")
        written = write_shards(self.data_dir, self.shard_dir, maxcount=maxcount,
                               progress=self.progress)
        zst_dir = self._tempdir("shards-zst-")  # only for the ratio
        zwritten = write_shards(self.data_dir, zst_dir, maxcount=maxcount, compress="zstd",
                                progress=False)
        shutil.rmtree(zst_dir)
        self.shard_paths = [self.shard_dir / s.name for s in written.manifest.shards]
        self.report = BenchReport(n_images=len(files), source_size=source_size,
                                  crop_size=self.crop_size, num_workers=self.num_workers,
                                  batch_size=self.batch_size, augment=self.augment,
                                  writer_images_per_minute=written.images_per_minute,
                                  num_shards=len(written.manifest.shards),
                                  zstd_ratio=zwritten.manifest.zstd_ratio)
        self.encoded = [p.read_bytes() for p in limit_sample(self.files)]
        # the naive path's one-core figure (a reference): 2,000 files spread over the set
        self.naive_sample = self.files[:: max(1, len(files) // 2000)][:2000]
        self.report.load_average.append(os.getloadavg()[0])

    def _tempdir(self, prefix: str) -> Path:
        self._dirs.append(Path(tempfile.mkdtemp(prefix=prefix, dir=self.work)))
        return self._dirs[-1]

    def _remove(self) -> None:
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def loader(self, name: str = "shards", output: str = "uint8") -> Iterable:
        """A fresh loader: "naive", "per_file" or "shards" (`output="float32"`: normalised on CPU)."""
        if name == "naive":
            return naive_loader(self.data_dir, self.batch_size, self.crop_size, self.augment,
                                self.num_workers)
        if name == "per_file":
            return per_file_loader(self.data_dir, self.batch_size, self.crop_size, self.augment,
                                   self.num_workers)
        if name != "shards":
            raise ValueError(f"loader name={name!r}: expected 'naive', 'per_file' or 'shards'")
        from ..data.loader import shard_loader

        return shard_loader(self.shard_dir, self.batch_size, train=True, image_size=self.crop_size,
                            augment=self.augment, num_workers=self.num_workers, rank=0,
                            world_size=1, pin_memory=False, seed=self.seed, output=output)

    def limit(self) -> Pass:
        """One pass of the pipeline limit over `encoded`, on one core."""
        return pipeline_limit(self.encoded, self.crop_size, self.augment, self.batch_size)

    def record(self, key: str, p: Pass) -> None:
        """Keep the best of the passes measured under `key`, for each clock."""
        r = self.report
        r.rates[key] = max(r.rates.get(key, 0.0), p.rate)
        r.cpu_rates[key] = max(r.cpu_rates.get(key, 0.0), p.cpu_rate)
        self.log(f"{key}: {p.rate:.0f} img/s, {p.cpu_rate:.0f} img/CPU-s over {p.images} images")

    def rounds(self, repeats: int = 1, cold: bool = True) -> None:
        """Every loader warm (and cold), the limit on one core and in parallel, the naive path on
        one core. Rounds interleave every measurement, so a burst of outside load hits all of them
        alike; each figure is the best of its rounds."""
        paths = {"naive": self.files, "per_file": self.files, "shards": self.shard_paths}
        for _ in range(max(1, repeats)):
            for name in ("naive", "per_file", "shards"):  # warm: read everything once, then measure
                for p in paths[name]:
                    p.read_bytes()
                self.record(f"{name}_warm", throughput(self.loader(name)))
            self.record("shards_f32_warm", throughput(self.loader("shards", "float32")))
            if cold:
                for name in ("per_file", "shards"):
                    pagecache.evict(paths[name])
                    self.report.cold_resident[name] = pagecache.resident_fraction(paths[name])
                    self.record(f"{name}_cold", throughput(self.loader(name)))
            self.record("limit_one_core", self.limit())
            self.record("naive_limit", naive_limit(self.naive_sample, self.crop_size, self.augment,
                                                   self.batch_size))
            if self.num_workers > 1:  # one process alone is the limit itself
                self.report.parallel_limit = max(self.report.parallel_limit, parallel_limit(
                    self.encoded, self.crop_size, self.augment, self.batch_size, self.num_workers))

    def finish(self, data_wait_steps: int = 30) -> BenchReport:
        """The limit scaled to the workers, the data-wait fractions, the load average: the report."""
        r = self.report
        r.limit_one_core = r.rates.pop("limit_one_core")
        r.naive_limit_one_core = r.rates.pop("naive_limit")
        r.rates["limit"] = r.limit_one_core * max(1, self.num_workers)
        r.cpu_rates["limit"] = r.cpu_rates.pop("limit_one_core")
        if data_wait_steps > 0:
            for name in ("naive", "shards"):
                r.data_wait[name] = data_wait_fraction(self.loader(name), len(self.classes),
                                                       data_wait_steps)
                self.log(f"data wait ({name}): {r.data_wait[name]:.0%}")
        r.load_average.append(os.getloadavg()[0])
        return r


def loader_bench(data_dir: str | os.PathLike | None = None, *, n: int = 10_000, image_size: int = 160,
              crop_size: int = 128, num_classes: int = 10, num_workers: int | None = None,
              batch_size: int = 64, augment: str = "basic",
              work_dir: str | os.PathLike | None = None, cold: bool = True,
              data_wait_steps: int = 30, shards_per_worker: int = 8, seed: int = 0,
              repeats: int = 1, progress: bool = True) -> BenchReport:
    """Measure gpu_lab's shard loader against the naive per-file pipeline (see module docstring)
    on `LoaderBench`'s images and shards (data_dir, n, ..., seed: as there). `repeats` rounds of
    every measurement, each figure the best of its rounds; `data_wait_steps` training steps for the
    data-wait fractions. The report is also written to `work_dir`/last_report.json."""
    with LoaderBench(data_dir, n=n, image_size=image_size, crop_size=crop_size,
                     num_classes=num_classes, num_workers=num_workers, batch_size=batch_size,
                     augment=augment, work_dir=work_dir, shards_per_worker=shards_per_worker,
                     seed=seed, progress=progress) as b:
        b.rounds(repeats, cold)
        report = b.finish(data_wait_steps)
    (b.work / "last_report.json").write_text(json.dumps(report.to_dict(), indent=1))
    return report
