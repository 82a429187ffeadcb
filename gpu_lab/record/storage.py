"""When the disk that holds a run's record cannot take more: full, over a quota, or read-only.

`trouble(exc, path)` tells those apart from a locked database or a bad event (SQLite says "database
or disk is full", or "disk I/O error" for a quota); `says(...)` is the note a user reads (the
path, the free space, what to do), never SQLite's wording alone. `Reserve` is a small file made
in advance beside the registry: released when the disk is full, its space takes the run's note
and its end, so that the end is recorded even on a full disk.
"""
from __future__ import annotations

import errno
import io
import os
import shutil
import sqlite3
from pathlib import Path

FULL, QUOTA, READ_ONLY = "full", "over quota", "read-only"
RESERVE_BYTES = 256 * 1024  # per recorder: a few hundred events, the note and the run's end
_SQLITE_FULL, _SQLITE_READONLY, _SQLITE_IOERR = 13, 8, 10
_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: QUOTA, errno.EROFS: READ_ONLY}


def trouble(exc: BaseException, path: str | os.PathLike) -> str | None:
    """FULL, QUOTA or READ_ONLY where `exc` (from writing at `path`) means the storage refuses
    more; None for anything else (a locked database, a bad event)."""
    if isinstance(exc, OSError) and exc.errno in _ERRNOS:
        return _ERRNOS[exc.errno]
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    text = str(exc).lower()
    if code == _SQLITE_FULL or "disk is full" in text:
        return FULL
    if (code is not None and code & 0xFF == _SQLITE_READONLY) or "readonly database" in text:
        return READ_ONLY
    if (code is not None and code & 0xFF == _SQLITE_IOERR) or "disk i/o error" in text:
        # SQLite says "disk I/O error" for EDQUOT; a disk with room left is then a quota
        return FULL if free_bytes(path) < RESERVE_BYTES else QUOTA
    return None


def free_bytes(path: str | os.PathLike) -> int:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 0


def says(kind: str, path: str | os.PathLike, waiting: int, dropped: int,
         paused_s: float | None = None) -> str:
    """The run's note about its record, in words: what happened where, what it costs, what to
    do. `paused_s`: how long it was paused, once it writes again."""
    where, free = _existing(path), fmt(free_bytes(path))
    is_ = "is" if paused_s is None else "was"
    what = {FULL: f"the disk holding {where} {is_} full",
            QUOTA: f"the disk quota for {where} {is_} used up",
            READ_ONLY: f"{where} {is_} on a read-only file system"}.get(kind, f"{where}: {kind}")
    if paused_s is None:
        head = (f"the record is paused: {what} ({free} free); {waiting} events waiting, "
                f"{dropped} dropped")
    else:
        head = (f"the record was paused for {paused_s:.0f} s: {what}; {dropped} events were "
                f"not written ({free} free now)")
    return (head + ". The training goes on. Free space there, or set GPU_LAB_HOME to a folder "
            "on another disk for the next runs (move ~/.gpu_lab there to keep the old ones)")


def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p if p.is_dir() else p.parent


class Reserve:
    """A file of RESERVE_BYTES made in advance (fallocate: real blocks, not a hole), given back
    when the disk is full so that the run's note and end still fit."""

    def __init__(self, folder: str | os.PathLike, name: str) -> None:
        self.path = Path(folder) / "reserve" / name
        self.held = False

    def make(self) -> bool:
        """Take the space (again); False where it cannot (the disk is full already)."""
        if self.held:
            return True
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            self.release()
            return False
        self.held = True
        return True

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.held = False


class LogStream(io.TextIOBase):
    """A rank's (or its supervisor's) stdout or stderr on its log file, unbuffered. A write the
    disk refuses (full, over quota, read-only) is counted (`lost_bytes()`), never raised: a
    print must not end a training because the log's disk is full."""

    _lost = {"bytes": 0}  # this process's, both streams

    @classmethod
    def reset(cls) -> None:
        cls._lost["bytes"] = 0

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.buffer = _RawLog(fd)

    encoding = "utf-8"
    errors = "replace"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        self.buffer.write(str(text).encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def reconfigure(self, **_kwargs: object) -> None:
        """A TextIOWrapper's: nothing to change in an unbuffered UTF-8 stream."""


class _RawLog:
    """The bytes side of a LogStream (`sys.stdout.buffer`)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: bytes) -> int:
        view = memoryview(bytes(data))
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                    raise
                LogStream._lost["bytes"] += len(view)
                break
        return len(data)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._fd


def lost_bytes() -> int:
    """How many bytes of this process's output its log's disk refused."""
    return LogStream._lost["bytes"]
