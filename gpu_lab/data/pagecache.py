"""The OS page cache, for cold-cache benchmarks: evict files from it and measure what stays resident.

A "cold" read has to come from the disk; a "warm" one is a memory copy. Benchmarks that forget the
difference measure RAM. `evict` asks the kernel to drop the cached pages of each file
(`posix_fadvise(POSIX_FADV_DONTNEED)`, after an fsync, because dirty pages are never dropped), and
`resident_fraction` checks with `mincore(2)` how much of the files is still cached, so a report can
say whether the eviction really happened (some file systems, e.g. tmpfs, ignore it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path
from typing import Iterable


def evict(paths: Iterable[str | os.PathLike]) -> int:
    """Drop `paths` from the page cache; returns the number of files advised."""
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_fraction(paths: Iterable[str | os.PathLike]) -> float:
    """Fraction (by pages) of the files' bytes that sit in the page cache now, via mincore(2)."""
    libc = _libc()
    page = mmap.PAGESIZE
    resident = total = 0
    for p in paths:
        size = Path(p).stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap failed for {p}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed for {p}")
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0
