"""Reading tar shards fast: open (plain, gzip or zstd, detected from the magic bytes) and iterate
members.

Python's `tarfile` spends about 30 µs of pure-Python header parsing per member; a WebDataset sample
has two or three members, and the whole per-sample budget of a loader on small JPEGs is about
400 µs of one core (decode + crop). The readers here parse the 512-byte headers themselves (ustar,
with GNU long names and pax path/size records: one `struct` unpack and one `int()` per numeric
field) in about 4 µs per member on the 2-vCPU development VM (5.3 µs with a slice and a parse per
field, 1.4x slower; medians of 10 alternated passes over 20,000 members), check each header's
checksum (the byte sum through Adler-32: exact, and six times faster than `sum()`), and raise
`TarFormatError` on a corrupt header or a truncated member, so a bad shard is caught where it goes
bad and not silently shortened.

Two readers share that parsing: `iter_members` over a stream (gzip and zstd shards, any file
object) returns each member's bytes; `iter_buffer_members` over a plain tar shard mapped into
memory (`map_shard`) returns views of the page cache. `shard_members` picks one for a shard.
"""
from __future__ import annotations

import gzip
import mmap
import os
import stat
import struct
import zlib
from contextlib import contextmanager
from typing import IO, Iterator

_BLOCK = 512
# the ustar header fields every member needs, in one unpack: name, size, checksum, type flag (mode,
# uid, gid and mtime skipped); the magic and the name prefix are read only when the prefix is set
_HEADER = struct.Struct("100s24x12s12x8s1s")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class TarFormatError(ValueError):
    """The tar stream is corrupt or ends in the middle of a member."""


def _path(url: str) -> str:
    return url[len("file:"):] if url.startswith("file:") else url


def _compressed(head: bytes) -> bool:
    return head.startswith(GZIP_MAGIC) or head[:4] == ZSTD_MAGIC


def open_shard(url: str) -> IO[bytes]:
    """A readable stream of the tar bytes of a shard file (`file:` prefix allowed): plain tar,
    gzip (`.tgz`, `.tar.gz`) or zstd (`.tar.zst`), told apart by their first bytes."""
    fh = open(_path(url), "rb", buffering=1 << 20)  # large reads: shards are read front to back
    head = fh.peek(4)[:4]
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=True)
    return fh


def map_shard(url: str) -> mmap.mmap | None:
    """A plain (uncompressed) tar shard file mapped read-only, for `iter_buffer_members`; None for
    a gzip or zstd shard, an empty file or anything but a regular file (read those through
    `open_shard`).

    The members then come straight out of the page cache: no read() copying every byte into the
    process and no allocation per member. The loader, in a DataLoader worker on 160 px JPEGs,
    against the pipeline limit's own loop in a worker on the same core (medians of 5 passes in
    turns, one run): 0.969 reading mapped shards, 0.953 reading them through read(); the
    copy-free reading alone was worth 2-4% of the worker's time in other runs. The one cost: a
    file that another process truncates while it is mapped kills the reader with SIGBUS where
    read() would have raised. Shards are written once (write_shards writes each to a temporary
    name and renames it: rewriting a set under a running loader replaces files, it never
    truncates a mapped one)."""
    with open(_path(url), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        if _compressed(f.read(4)):
            return None
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the mapping outlives the fd


def _complete(stream: IO[bytes], data: bytes, n: int) -> bytes:
    """`data` (a short read) followed by more reads up to n bytes; fewer only at the end of the
    stream (compressed streams may return short reads)."""
    if not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _octal(field: bytes, what: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"corrupt tar header at byte {offset}: {what} field {field!r}") from None


def byte_sum(header: bytes) -> int:
    """The sum of a 512-byte header's bytes, exactly, about 6x faster than `sum()`: Adler-32's low
    half is 1 + the byte sum modulo 65521, and 256 bytes sum to at most 65280, so each half of the
    header gives its sum exactly."""
    return (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2


def _pax_records(data: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(data):
        sp = data.index(b" ", i)
        length = int(data[i:sp])
        key, _, value = data[sp + 1:i + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        i += length
    return out


def _number(field: bytes, what: str, offset: int) -> int:
    """A numeric header field: octal digits up to the first NUL, spaces around them (as tarfile reads
    it; int() strips the spaces), else the general rules of `_octal` (empty, base-256, corrupt)."""
    try:
        return int(field.split(b"\0", 1)[0], 8)
    except ValueError:
        return _octal(field, what, offset)


def _header(buf: bytes | memoryview, pos: int, offset: int) -> tuple[bytes, int, bytes] | None:
    """(name, size, type flag) of the 512-byte tar header at `buf[pos:]`, checksum checked; None
    for the all-zero block that ends an archive. `offset`: where it starts in the archive, for the
    error messages."""
    total = byte_sum(buf[pos:pos + _BLOCK])
    if total == 0:
        return None
    name, size_field, checksum, kind = _HEADER.unpack_from(buf, pos)
    # checksum: unsigned byte sum with the checksum field counted as 8 spaces (an 8-byte sum is
    # exact in Adler-32's low half too)
    if total - (zlib.adler32(checksum) & 0xFFFF) + 1 + 8 * 32 != \
            _number(checksum, "checksum", offset):
        raise TarFormatError(f"corrupt tar header at byte {offset} (checksum mismatch)")
    name = name.split(b"\0", 1)[0]
    if buf[pos + 345] and buf[pos + 257:pos + 262] == b"ustar":  # a ustar name prefix
        name = bytes(buf[pos + 345:pos + 500]).split(b"\0", 1)[0] + b"/" + name
    return name, _number(size_field, "size", offset), kind


def _extended(kind: bytes, data: bytes | memoryview, ext: dict[str, str]) -> bool:
    """Whether a member of this type flag only describes the next one: a pax header's records (path,
    size) or a GNU long name go into `ext`; a global pax header is skipped."""
    if kind == b"x":  # pax header for the next member
        ext.update(_pax_records(bytes(data)))
    elif kind == b"L":  # GNU long name for the next member
        ext["path"] = bytes(data).rstrip(b"\0").decode("utf-8", "surrogateescape")
    elif kind != b"g":  # g: global pax header, nothing gpu_lab needs
        return False
    return True


def _name(name: bytes, ext: dict[str, str]) -> str:
    return ext.get("path") or name.decode("utf-8", "surrogateescape")


_REGULAR = (b"0", b"\0", b"7")  # regular file (7: contiguous file)


@contextmanager
def shard_members(url: str) -> Iterator[Iterator[tuple[str, bytes | memoryview]]]:
    """The members of a shard as `(name, data)`: views of the mapped file for a plain tar
    (`map_shard`, `iter_buffer_members`), else bytes read through `open_shard` (closed on exit)."""
    mapped = map_shard(url)
    if mapped is not None:
        yield iter_buffer_members(mapped)  # unmapped once the last view of it is gone
        return
    with open_shard(url) as stream:
        yield iter_members(stream)


def iter_members(stream: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in a tar stream, in order."""
    read = stream.read
    offset = 0
    ext: dict[str, str] = {}  # what pax headers and GNU long names say about the next member
    while True:
        block = read(_BLOCK)
        if len(block) != _BLOCK:
            if not block:
                return  # EOF without the end-of-archive blocks: tolerated, as tarfile does
            block = _complete(stream, block, _BLOCK)
            if len(block) < _BLOCK:
                raise TarFormatError(f"truncated tar header at byte {offset} ({len(block)} of 512 "
                                     f"bytes)")
        head = _header(block, 0, offset)
        if head is None:
            return  # end-of-archive marker
        name, size, kind = head
        offset += _BLOCK
        if ext and ext.get("size"):
            size = int(ext["size"])
        padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
        data = read(padded)
        if len(data) != padded:
            data = _complete(stream, data, padded)
            if len(data) < size:
                raise TarFormatError(f"unexpected end of data in member "
                                     f"{_name(name, ext)!r} at byte {offset} "
                                     f"({len(data)} of {size} bytes)")
        offset += padded
        if padded != size:
            data = data[:size]
        if kind in _REGULAR:
            yield _name(name, ext), data
        elif _extended(kind, data, ext):
            continue
        ext.clear()


def iter_buffer_members(buf: bytes | mmap.mmap | memoryview) -> Iterator[tuple[str, memoryview]]:
    """(name, data) of every regular file in tar bytes held in memory (a shard from `map_shard`),
    in order, with the same checks as `iter_members`. Each data is a view of `buf`: no copy, and
    it keeps `buf` alive (and mapped) while anything holds it."""
    view = memoryview(buf)
    end, pos = len(view), 0
    ext: dict[str, str] = {}
    while True:
        if end - pos < _BLOCK:
            if pos == end:
                return
            raise TarFormatError(f"truncated tar header at byte {pos} ({end - pos} of 512 bytes)")
        head = _header(view, pos, pos)
        if head is None:
            return
        name, size, kind = head
        pos += _BLOCK
        if ext and ext.get("size"):
            size = int(ext["size"])
        if end - pos < size:
            raise TarFormatError(f"unexpected end of data in member {_name(name, ext)!r} at byte "
                                 f"{pos} ({end - pos} of {size} bytes)")
        data = view[pos:pos + size]
        pos = min(end, pos + (size + _BLOCK - 1) // _BLOCK * _BLOCK)
        if kind in _REGULAR:
            yield _name(name, ext), data
        elif _extended(kind, data, ext):
            continue
        ext.clear()
