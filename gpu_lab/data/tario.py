"""Reading tar shards fast: open (plain, gzip or zstd, detected from the magic bytes) and iterate members.

Python's `tarfile` spends about 30 µs of pure-Python header parsing per member; a WebDataset sample
has two or three members, and the whole per-sample budget of a loader on small JPEGs is about
400 µs of one core (decode + crop). `iter_members` parses the 512-byte headers itself (ustar, with
GNU long names and pax path/size records: one `struct` unpack and one `int()` per numeric field) in
about 4 µs per member on the 2-vCPU development VM (5.3 µs with a slice and a parse per field, 1.4x
slower; medians of 10 alternated passes over 20,000 members), checks each header's checksum (the
byte sum through Adler-32: exact, and six times faster than `sum()`), and raises `TarFormatError`
on a corrupt header or a truncated member, so a bad shard is caught where it goes bad and not
silently shortened.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from typing import IO, Iterator

_BLOCK = 512
# the ustar header fields the reader uses, in one unpack: name, size, checksum, type flag, magic,
# prefix (mode, uid, gid, mtime, link name, version, user and group, device numbers skipped)
_HEADER = struct.Struct("100s24x12s12x8s1s100x5s83x155s")
_ZERO_BLOCK = bytes(_BLOCK)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class TarFormatError(ValueError):
    """The tar stream is corrupt or ends in the middle of a member."""


def open_shard(url: str) -> IO[bytes]:
    """A readable stream of the tar bytes of a shard file (`file:` prefix allowed): plain tar,
    gzip (`.tgz`, `.tar.gz`) or zstd (`.tar.zst`), told apart by their first bytes."""
    path = url[len("file:"):] if url.startswith("file:") else url
    fh = open(path, "rb", buffering=1 << 20)  # large reads: shards are read front to back
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


def iter_members(stream: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in a tar stream, in order."""
    read, unpack = stream.read, _HEADER.unpack_from
    offset = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = read(_BLOCK)
        if len(header) != _BLOCK:
            if not header:
                return  # EOF without the end-of-archive blocks: tolerated, as tarfile does
            header = _complete(stream, header, _BLOCK)
            if len(header) < _BLOCK:
                raise TarFormatError(f"truncated tar header at byte {offset} ({len(header)} of 512 bytes)")
        if header == _ZERO_BLOCK:
            return  # end-of-archive marker
        name, size_field, checksum, kind, magic, prefix = unpack(header)
        # checksum: unsigned byte sum with the checksum field counted as 8 spaces (an 8-byte sum
        # is exact in Adler-32's low half too)
        if byte_sum(header) - (zlib.adler32(checksum) & 0xFFFF) + 1 + 8 * 32 != \
                _number(checksum, "checksum", offset):
            raise TarFormatError(f"corrupt tar header at byte {offset} (checksum mismatch)")
        size = _number(size_field, "size", offset)
        name = name.split(b"\0", 1)[0]
        if magic == b"ustar" and prefix[0]:
            name = prefix.split(b"\0", 1)[0] + b"/" + name
        offset += _BLOCK
        if pax.get("size"):
            size = int(pax["size"])
        padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
        data = read(padded)
        if len(data) != padded:
            data = _complete(stream, data, padded)
            if len(data) < size:
                raise TarFormatError(f"unexpected end of data in member "
                                     f"{name.decode(errors='replace')!r} at byte {offset} "
                                     f"({len(data)} of {size} bytes)")
        offset += padded
        if padded != size:
            data = data[:size]
        if kind == b"x":  # pax header for the next member
            pax = _pax_records(data)
            continue
        if kind == b"g":  # global pax header: nothing gpu_lab needs
            continue
        if kind == b"L":  # GNU long name for the next member
            long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        member = long_name or pax.get("path") or name.decode("utf-8", "surrogateescape")
        long_name = None
        if pax:
            pax = {}
        if kind in (b"0", b"\0", b"7"):  # regular file (7: contiguous file)
            yield member, data
