"""Reading tar shards fast: open (plain, gzip or zstd, detected from the magic bytes) and iterate
members.

Python's `tarfile` parses headers in pure Python, several times the whole per-member budget of a
loader on small JPEGs. Here one loop (`_members`) parses the 512-byte ustar headers itself (GNU
long names and pax path/size records too: one `struct` unpack and one `int()` per numeric field),
checks each header's checksum (the byte sum through Adler-32: exact, and far faster than `sum()`),
and raises `TarFormatError` on a corrupt header or a truncated member, so a bad shard is caught
where it goes bad and not silently shortened.

The loop reads through one of three readers: a plain tar file (one readv per member, straight into
the member's own bytearray), a stream (gzip and zstd shards, any file object), or tar bytes in
memory (views, no copy). `shard_members` picks one for a shard. Shards are read, not memory-mapped:
a file that another process truncates while it is mapped kills the reader with SIGBUS, where a
read just comes back short and the reader raises TarFormatError naming the member.
"""
from __future__ import annotations

import gzip
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


def _entry(buf, pos: int, offset: int, ext: dict[str, str]) -> tuple[bytes, int, bytes, int] | None:
    """(name, size, type flag, padded size) of the header at `buf[pos:]`, with the size a pax
    record gave it; None at the end-of-archive block."""
    head = _header(buf, pos, offset)
    if head is None:
        return None
    name, size, kind = head
    if ext and ext.get("size"):
        size = int(ext["size"])
    return name, size, kind, (size + _BLOCK - 1) // _BLOCK * _BLOCK


@contextmanager
def shard_members(url: str) -> Iterator[Iterator[tuple[str, bytes | bytearray]]]:
    """The members of a shard as `(name, data)`: a plain tar read with `iter_file_members` (one
    readv per member, straight into each member's own bytearray), a compressed one (or any file
    on a system without readv) through `open_shard` and `iter_members`. Closed on exit."""
    with open(_path(url), "rb", buffering=0) as f:
        fd = f.fileno()
        if _READV and stat.S_ISREG(os.fstat(fd).st_mode) and not _compressed(os.pread(fd, 4, 0)):
            yield iter_file_members(fd)
            return
    with open_shard(url) as stream:
        yield iter_members(stream)


_READV = hasattr(os, "readv") and hasattr(os, "pread")  # not on Windows: it streams instead
_PAD = bytearray(_BLOCK)  # where the padding after a member's data goes (never read)
_PADS = [memoryview(_PAD)[:n] for n in range(_BLOCK)]


def _readv_full(fd: int, buffers: list, total: int = 0) -> int:
    """os.readv until `buffers` are full or the file ends; the bytes read (`total` of them read
    already). A regular file returns short reads only at its end, but not every file system says
    so on the first short read."""
    want = sum(map(len, buffers))
    got = -1
    if not total:
        total = got = os.readv(fd, buffers)
    while got and total < want:
        rest, skip = [], total
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(memoryview(b)[skip:])
            skip = 0
        got = os.readv(fd, rest)
        total += got
    return total


class _FileReader:
    """A plain tar file: one readv per member fills its data (a bytearray of its own, which
    `transforms.decode` uses without a copy), skips its padding and reads the next header."""

    __slots__ = ("fd", "head", "have")

    def __init__(self, fd: int) -> None:
        self.fd, self.head = fd, bytearray(_BLOCK)  # reused: _header copies out what it returns
        self.have = _readv_full(fd, [self.head])  # bytes of the next header read so far

    def header(self) -> bytes | bytearray:
        return self.head if self.have == _BLOCK else self.head[:self.have]

    def member(self, size: int, padded: int) -> tuple[bytearray, int]:
        data = bytearray(size)
        parts = [data, _PADS[padded - size], self.head]
        got = os.readv(self.fd, parts)
        if got < padded + _BLOCK:  # the file ends here, or (rarely) a short read to complete
            got = _readv_full(self.fd, parts, got)
        self.have = max(0, got - padded)
        return data, got


class _StreamReader:
    """Any file object (a gzip or zstd stream)."""

    __slots__ = ("stream", "read")

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream, self.read = stream, stream.read

    def header(self) -> bytes:
        block = self.read(_BLOCK)
        return _complete(self.stream, block, _BLOCK) if 0 < len(block) < _BLOCK else block

    def member(self, size: int, padded: int) -> tuple[bytes, int]:
        data = self.read(padded)
        if len(data) != padded:
            data = _complete(self.stream, data, padded)
        got = len(data)
        return (data[:size] if padded != size and got >= size else data), got


class _BufferReader:
    """Tar bytes in memory: members are views of them, no copy."""

    __slots__ = ("view", "pos", "end")

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.view, self.pos = memoryview(buf), 0
        self.end = len(self.view)

    def header(self) -> memoryview:
        head = self.view[self.pos:self.pos + _BLOCK]
        self.pos += len(head)
        return head

    def member(self, size: int, padded: int) -> tuple[memoryview, int]:
        got = min(self.end - self.pos, padded)
        data = self.view[self.pos:self.pos + size]
        self.pos = min(self.end, self.pos + padded)
        return data, got


def _members(reader) -> Iterator[tuple[str, bytes | bytearray | memoryview]]:
    """The one loop over a tar's members, whatever `reader` reads from: (name, data) of every
    regular file, with pax and GNU long-name records applied, and TarFormatError on a truncated
    header or member (a bad shard is caught where it goes bad, not silently shortened)."""
    offset = 0
    ext: dict[str, str] = {}  # what pax headers and GNU long names say about the next member
    header, member = reader.header, reader.member
    while True:
        head = header()
        if len(head) < _BLOCK:
            if not len(head):
                return  # EOF without the end-of-archive blocks: tolerated, as tarfile does
            raise TarFormatError(f"truncated tar header at byte {offset} ({len(head)} of 512 bytes)")
        entry = _entry(head, 0, offset, ext)
        if entry is None:
            return  # end-of-archive marker
        name, size, kind, padded = entry
        offset += _BLOCK
        data, got = member(size, padded)
        if got < size:
            raise TarFormatError(f"unexpected end of data in member {_name(name, ext)!r} at byte "
                                 f"{offset} ({got} of {size} bytes)")
        offset += padded
        if kind in _REGULAR:
            yield _name(name, ext), data
        elif _extended(kind, data, ext):
            continue
        ext.clear()


def iter_file_members(fd: int) -> Iterator[tuple[str, bytearray]]:
    """(name, data) of every regular file in the plain tar file open as `fd` (read from its current
    position on). A file that shrinks while it is read ends with TarFormatError: reading, unlike a
    memory mapping, cannot turn a truncation into SIGBUS."""
    return _members(_FileReader(fd))


def iter_members(stream: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in a tar stream, in order."""
    return _members(_StreamReader(stream))


def iter_buffer_members(buf: bytes | bytearray | memoryview) -> Iterator[tuple[str, memoryview]]:
    """(name, data) of every regular file in tar bytes held in memory, in order; each data is a
    view of `buf` (no copy; it keeps `buf` alive while anything holds it)."""
    return _members(_BufferReader(buf))
