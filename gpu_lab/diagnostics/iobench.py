"""I/O benchmark for a data directory, and a live iostat-like view of the disks during a run.

A slow input pipeline is first an I/O question (what `iostat -x 1` shows), before more loader
workers or prefetch. Two questions come before tuning the loader: how fast can this directory be read at all, and is the disk busy
while training runs?

`io_bench(path)` reads the files already there (or a test file it writes, with write_test_mb):
- sequential: whole files in 4 MiB blocks, as a shard reader does → MB/s;
- random: 4 KiB reads at random offsets, as a loader of small files does → IOPS and MB/s.
Before each pass the files are evicted from the page cache (posix_fadvise DONTNEED), and the
report says how much of them stayed cached anyway (mincore): tmpfs and some network or overlay
file systems ignore the eviction, and a warm read measures memory, not the disk.

`DiskMonitor` samples /proc/diskstats through psutil, like `iostat -x 1`: read and write MB/s,
reads and writes per second, and %util (the share of time the device was busy).
"""
from __future__ import annotations

import html
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..units import MiB

SEQ_BLOCK = 4 * MiB
RAND_BLOCK = 4096


@dataclass
class IOResult:
    path: str
    files: int
    bytes_total: int
    seq_mb_s: float
    seq_bytes: int
    rand_iops: float
    rand_mb_s: float
    rand_reads: int
    block_size: int
    cached_fraction_seq: float | None     # share of the bytes the page cache still held before the pass
    cached_fraction_rand: float | None
    filesystem: str | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        def cache(f: float | None) -> str:
            return "cache state unknown" if f is None else (
                "cold" if f < 0.05 else f"{f:.0%} still cached: partly a memory read")
        lines = [f"I/O benchmark of {self.path} ({self.filesystem or '?'}; {self.files} file(s), "
                 f"{self.bytes_total / MiB:.1f} MiB)",
                 f"  sequential read ({SEQ_BLOCK // MiB} MiB blocks): {self.seq_mb_s:10.1f} MB/s   "
                 f"[{cache(self.cached_fraction_seq)}]",
                 f"  random read ({self.block_size // 1024} KiB):        {self.rand_iops:10.0f} IOPS "
                 f"= {self.rand_mb_s:.1f} MB/s   [{cache(self.cached_fraction_rand)}]"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def _filesystem(path: Path) -> str | None:
    """The file-system type of `path` (the longest mount point above it in /proc/mounts)."""
    try:
        best, fs = "", None
        p = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, fs = parts[1], parts[2]
        return fs
    except OSError:
        return None


def _files(root: Path, limit_bytes: int) -> list[Path]:
    out, total = [], 0
    if root.is_file():
        return [root]
    for dirpath, _, names in os.walk(root):
        for n in sorted(names):
            p = Path(dirpath) / n
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if size == 0 or not p.is_file():
                continue
            out.append(p)
            total += size
            if total >= limit_bytes:
                return out
    return out


def _evict(files: list[Path]) -> float | None:
    """Drop the files from the page cache; the fraction that is still resident afterwards."""
    try:
        from ..data.pagecache import evict, resident_fraction
    except ImportError:  # pragma: no cover - gpu_lab.data ships with diagnostics
        return None
    try:
        evict(files)
        return resident_fraction(files)
    except OSError:
        return None


def io_bench(path: str | os.PathLike, *, max_mb: int = 1024, rand_reads: int = 2000,
             write_test_mb: int | None = None, seed: int = 0) -> IOResult:
    """Sequential and random read throughput of the files under `path` (up to `max_mb` of them).

    write_test_mb: write a test file of that size into `path` first (and remove it after) — for
    an empty directory, or to benchmark the disk rather than your data.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"io_bench: {root} does not exist; pass a data directory or file")
    test_file = None
    notes = []
    if write_test_mb:
        if not root.is_dir():
            raise ValueError(f"io_bench: write_test_mb needs a directory; {root} is a file")
        test_file = root / f".gpu_lab_iobench_{os.getpid()}.bin"
        chunk = os.urandom(MiB)
        with open(test_file, "wb") as f:
            for _ in range(write_test_mb):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    try:
        files = [test_file] if test_file else _files(root, max_mb * MiB)
        if not files:
            raise ValueError(f"io_bench: no readable non-empty file under {root}; pass "
                             "write_test_mb=256 to benchmark the disk with a test file")
        sizes = [p.stat().st_size for p in files]
        total = sum(sizes)
        # sequential: every file front to back in large blocks
        cached_seq = _evict(files)
        buf = bytearray(SEQ_BLOCK)
        t0 = time.perf_counter()
        read = 0
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    read += n
        seq_t = time.perf_counter() - t0
        # random: 4 KiB at random aligned offsets, spread over the files by size
        cached_rand = _evict(files)
        rng = random.Random(seed)
        cum = []
        acc = 0
        for s in sizes:
            acc += s
            cum.append(acc)
        fds = [os.open(p, os.O_RDONLY) for p in files]
        try:
            t0 = time.perf_counter()
            for _ in range(rand_reads):
                x = rng.randrange(total)
                i = next(j for j, c in enumerate(cum) if x < c)
                off = (x - (cum[i] - sizes[i])) // RAND_BLOCK * RAND_BLOCK
                os.pread(fds[i], RAND_BLOCK, off)
            rand_t = time.perf_counter() - t0
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        if test_file is not None and test_file.exists():
            test_file.unlink()
    fs = _filesystem(root)
    if fs in ("tmpfs", "ramfs"):
        notes.append(f"{fs} lives in RAM: these are memory speeds, not a disk's")
    if cached_seq is not None and cached_seq > 0.5:
        notes.append("the page cache kept the files despite the eviction: the numbers are warm "
                     "reads; benchmark a directory on the real disk, or a larger file")
    return IOResult(path=str(root), files=len(files), bytes_total=total,
                    seq_mb_s=read / seq_t / 1e6 if seq_t > 0 else float("inf"), seq_bytes=read,
                    rand_iops=rand_reads / rand_t if rand_t > 0 else float("inf"),
                    rand_mb_s=rand_reads * RAND_BLOCK / rand_t / 1e6 if rand_t > 0 else float("inf"),
                    rand_reads=rand_reads, block_size=RAND_BLOCK,
                    cached_fraction_seq=cached_seq, cached_fraction_rand=cached_rand,
                    filesystem=fs, notes=notes)


# ------------------------------------------------------------------------------ live iostat

@dataclass
class DiskSample:
    t: float
    disk: str
    read_mb_s: float
    write_mb_s: float
    reads_per_s: float
    writes_per_s: float
    util_pct: float | None   # busy time / wall time (None where the kernel does not report it)


class DiskMonitor:
    """`iostat -x 1` in a thread: per-disk rates every `interval` seconds.

        mon = DiskMonitor(interval=1.0, on_sample=print)   # or read mon.samples
        mon.start(); ...; mon.stop()

    Also a context manager. `disks`: names to watch (default: every disk with activity; partitions
    and loop devices are skipped). Samples are kept in a bounded list (`maxlen`).
    """

    def __init__(self, interval: float = 1.0, disks: list[str] | None = None,
                 on_sample: Callable[[list[DiskSample]], None] | None = None,
                 maxlen: int = 3600, counters: Callable[[], dict] | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"DiskMonitor.interval: got {interval!r}; accepted: seconds > 0")
        self.interval = interval
        self.disks = disks
        self.on_sample = on_sample
        self.maxlen = maxlen
        self.samples: list[DiskSample] = []
        self._counters = counters
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev: tuple[float, dict] | None = None

    def _read(self) -> dict:
        if self._counters is not None:
            return self._counters()
        import psutil

        return psutil.disk_io_counters(perdisk=True) or {}

    def _wanted(self, name: str) -> bool:
        if self.disks is not None:
            return name in self.disks
        if name.startswith(("loop", "ram", "zram", "dm-", "sr")):
            return False
        # whole disks only: sda (not sda1), nvme0n1 (not nvme0n1p1), vda, xvda
        if name.startswith("nvme") or name.startswith("mmcblk"):
            return "p" not in name.split("n", 1)[-1]
        return not name[-1].isdigit()

    def sample(self) -> list[DiskSample]:
        """Take one sample now (rates since the previous call; [] on the first call)."""
        now = time.monotonic()
        cur = self._read()
        prev, self._prev = self._prev, (now, cur)
        if prev is None:
            return []
        dt = now - prev[0]
        if dt <= 0:
            return []
        out = []
        for name, c in cur.items():
            p = prev[1].get(name)
            if p is None or not self._wanted(name):
                continue
            busy = getattr(c, "busy_time", None)
            pbusy = getattr(p, "busy_time", None)
            util = (min(100.0, (busy - pbusy) / 1000 / dt * 100)
                    if busy is not None and pbusy is not None else None)
            out.append(DiskSample(time.time(), name, (c.read_bytes - p.read_bytes) / dt / 1e6,
                                  (c.write_bytes - p.write_bytes) / dt / 1e6,
                                  (c.read_count - p.read_count) / dt,
                                  (c.write_count - p.write_count) / dt, util))
        self.samples.extend(out)
        del self.samples[:-self.maxlen]
        return out

    def _loop(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval):
            batch = self.sample()
            if batch and self.on_sample is not None:
                try:
                    self.on_sample(batch)
                except Exception:  # noqa: BLE001 - a display error must not stop the monitor
                    pass

    def start(self) -> "DiskMonitor":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="gpu_lab-iostat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1)
            self._thread = None

    def __enter__(self) -> "DiskMonitor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @staticmethod
    def format(samples: list[DiskSample]) -> str:
        """iostat -x style lines for one batch of samples."""
        lines = [f"{'Device':<10} {'r/s':>8} {'w/s':>8} {'rMB/s':>9} {'wMB/s':>9} {'%util':>6}"]
        for s in samples:
            util = "   n/a" if s.util_pct is None else f"{s.util_pct:6.1f}"
            lines.append(f"{s.disk:<10} {s.reads_per_s:8.1f} {s.writes_per_s:8.1f} "
                         f"{s.read_mb_s:9.2f} {s.write_mb_s:9.2f} {util}")
        return "\n".join(lines)


__all__ = ["io_bench", "IOResult", "DiskMonitor", "DiskSample"]
