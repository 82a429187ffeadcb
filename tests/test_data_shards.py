"""write_shards: real tar files, a manifest that tells the truth, zstd measured, the CLI, the reader."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gpu_lab.data import ShardManifest, make_synthetic_images, verify_shards, write_shards
from gpu_lab.data.tario import (TarFormatError, byte_sum, iter_buffer_members, iter_file_members,
                                iter_members, open_shard, shard_members)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_synthetic_images(root, 60, image_size=32, num_classes=4, seed=0)
    return root


def _tar_samples(path: Path) -> dict[str, dict[str, bytes]]:
    """Read a shard with Python's own tarfile (an independent reader)."""
    out: dict[str, dict[str, bytes]] = {}
    with open_shard(str(path)) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        for m in tar:
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def test_shards_hold_every_source_image_once_with_its_label(images, tmp_path):
    rep = write_shards(images, tmp_path / "s", maxcount=16, include_json=True, progress=False)
    m = rep.manifest
    assert [s.count for s in m.shards] == [16, 16, 16, 12]
    assert m.num_samples == 60 and m.classes == sorted(p.name for p in images.iterdir())
    assert ShardManifest.load(tmp_path / "s").to_dict() == m.to_dict()
    seen = {}
    for s in m.shards:
        p = tmp_path / "s" / s.name
        assert p.stat().st_size == s.bytes == s.raw_bytes
        assert hashlib.sha256(p.read_bytes()).hexdigest() == s.sha256
        samples = _tar_samples(p)
        assert len(samples) == s.count
        for key, sample in samples.items():
            meta = json.loads(sample["json"])
            assert meta["path"] not in seen
            seen[meta["path"]] = sample
            assert sample["jpg"] == (images / meta["path"]).read_bytes()
            assert m.classes[int(sample["cls"])] == meta["class"] == Path(meta["path"]).parent.name
    assert sorted(seen) == sorted(str(p.relative_to(images)) for p in images.rglob("*.jpg"))
    # shuffled before sharding: a shard holds several classes, not one
    first = _tar_samples(tmp_path / "s" / m.shards[0].name)
    assert len({s["cls"] for s in first.values()}) > 1
    assert verify_shards(tmp_path / "s") == []
    (tmp_path / "s" / m.shards[1].name).write_bytes(b"tampered")
    assert verify_shards(tmp_path / "s") == [m.shards[1].name]


def test_maxsize_starts_new_shards_and_reruns_are_identical(images, tmp_path):
    a = write_shards(images, tmp_path / "a", maxsize=20_000, progress=False).manifest
    b = write_shards(images, tmp_path / "b", maxsize=20_000, progress=False).manifest
    assert len(a.shards) > 2
    # maxsize, rounded up to tar's 10 KiB record
    assert all(s.raw_bytes <= math.ceil(20_000 / 10_240) * 10_240 for s in a.shards)
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]


def test_zstd_shards_report_the_measured_ratio(images, tmp_path):
    rep = write_shards(images, tmp_path / "z", maxcount=30, compress="zstd", progress=False)
    m = rep.manifest
    assert [s.name for s in m.shards] == ["shard-000000.tar.zst", "shard-000001.tar.zst"]
    assert m.zstd_ratio == pytest.approx(m.raw_bytes / m.bytes)
    print("\n" + rep.summary())
    samples = _tar_samples(tmp_path / "z" / m.shards[0].name)
    assert len(samples) == 30 and all(s["jpg"][:2] == b"\xff\xd8" for s in samples.values())


def test_iterable_sources_dicts_and_pairs(images, tmp_path):
    files = sorted(images.rglob("*.jpg"))[:5]
    dicts = [{"__key__": f"k{i}", "jpg": f.read_bytes(), "cls": i % 2, "json": {"i": i}}
             for i, f in enumerate(files)]
    m = write_shards(dicts, tmp_path / "d", include_json=True, classes=["a", "b"], progress=False).manifest
    got = _tar_samples(tmp_path / "d" / m.shards[0].name)
    assert sorted(got) == [f"k{i}" for i in range(5)] and json.loads(got["k3"]["json"]) == {"i": 3}
    assert m.classes == ["a", "b"]
    pairs = [(f, 1) for f in files[:2]] + [(files[2].read_bytes(), 0)]
    m2 = write_shards(pairs, tmp_path / "p", progress=False).manifest
    got2 = _tar_samples(tmp_path / "p" / m2.shards[0].name)
    assert [got2[k]["cls"] for k in sorted(got2)] == [b"1", b"1", b"0"]
    assert m2.classes == ["0", "1"]


def test_bad_arguments_are_named(images, tmp_path):
    with pytest.raises(ValueError, match=r"compress='gzip': expected one of \(None, 'zstd'\)"):
        write_shards(images, tmp_path / "x", compress="gzip")
    with pytest.raises(ValueError, match="maxcount=0"):
        write_shards(images, tmp_path / "x", maxcount=0)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        write_shards(tmp_path / "nope", tmp_path / "x")
    write_shards(images, tmp_path / "twice", progress=False)
    with pytest.raises(FileExistsError, match="already holds"):
        write_shards(images, tmp_path / "twice", progress=False)
    with pytest.raises(ValueError, match=r"__key__='a\.b' contains '\.'"):
        write_shards([{"__key__": "a.b", "jpg": b"\xff\xd8\xff", "cls": 0}], tmp_path / "k", progress=False)


def test_writer_speed(tmp_path):
    """Prints images/min (issue #5 asks for >= 10,000 on this machine; no timing assertion)."""
    src = tmp_path / "img"
    make_synthetic_images(src, 400, image_size=64, num_classes=10, seed=1)
    rep = write_shards(src, tmp_path / "s", maxcount=100, progress=False)
    zrep = write_shards(src, tmp_path / "z", maxcount=100, compress="zstd", progress=False)
    print(f"\nshard writer: {rep.images_per_minute:,.0f} images/min (tar), "
          f"{zrep.images_per_minute:,.0f} images/min (tar.zst)")
    assert rep.manifest.num_samples == zrep.manifest.num_samples == 400


def test_cli_writes_shards(images, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "gpu_lab.cli", "shards", str(images), str(out),
                        "--maxcount", "25", "--compress", "zstd", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "60 samples, 4 classes -> 3 shards" in r.stdout and "zstd:" in r.stdout
    assert ShardManifest.load(out).num_samples == 60


# --------------------------------------------------------------------------- the tar reader

def _tar(fmt: int, names: list[str], size: int = 700) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for i, name in enumerate(names):
            data = bytes([i % 256]) * (size + i)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        d = tarfile.TarInfo("a_directory")
        d.type = tarfile.DIRTYPE
        t.addfile(d)
    return buf.getvalue()


def _read_members(path, how: str) -> list[tuple[str, bytes]]:
    """A shard's members through the stream reader, the file reader (readv) or the in-memory one."""
    if how == "stream":
        with open_shard(str(path)) as s:
            return list(iter_members(s))
    if how == "file":
        with open(path, "rb", buffering=0) as f:
            return [(name, bytes(data)) for name, data in iter_file_members(f.fileno())]
    return [(name, bytes(view)) for name, view in iter_buffer_members(Path(path).read_bytes())]


READERS = ["stream", "file", "buffer"]


@pytest.mark.parametrize("how", READERS)
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_reader_agrees_with_tarfile(tmp_path, fmt, how):
    names = ["x.jpg", "x.cls", "p" * 120 + "/x.jpg"] if fmt == tarfile.USTAR_FORMAT else \
        ["d" * 120 + "/long.jpg", "ünï/é.cls", "y" * 180 + ".png"]
    raw = _tar(fmt, names)
    pairs = [(tmp_path / "a.tar", raw)]
    if how == "stream":  # a compressed shard is never mapped (see the test below)
        pairs.append((tmp_path / "a.tgz", gzip.compress(raw)))
    for path, data in pairs:
        path.write_bytes(data)
        mine = _read_members(path, how)
        with tarfile.open(path) as t:
            theirs = [(m.name, t.extractfile(m).read()) for m in t if m.isreg()]
        assert mine == theirs


@pytest.mark.parametrize("how", READERS)
@pytest.mark.parametrize("size_field", ["%011o\0", "%11o ", " %09o \0", "base-256"])
@pytest.mark.parametrize("checksum_field", ["%06o\0 ", "%07o\0", " %06o ", "%o\0\0\0\0\0"])
def test_tar_reader_reads_numeric_fields_as_tarfile_does(tmp_path, size_field, checksum_field,
                                                        how):
    """Writers pad octal fields with NULs or spaces (and GNU tar may store sizes in base-256): the
    reader's one-call fast path and its general rules agree with tarfile on each of them."""
    raw = bytearray(_tar(tarfile.USTAR_FORMAT, ["a.jpg", "a.cls"]))
    size = 700
    if size_field == "base-256":
        raw[124:136] = b"\x80" + size.to_bytes(11, "big")
    else:
        raw[124:136] = (size_field % size).encode()
    raw[148:156] = b" " * 8
    raw[148:156] = (checksum_field % sum(raw[:512])).encode()[:8].ljust(8, b"\0")
    p = tmp_path / "t.tar"
    p.write_bytes(bytes(raw))
    mine = _read_members(p, how)
    with tarfile.open(p) as t:
        theirs = [(m.name, t.extractfile(m).read()) for m in t if m.isreg()]
    assert mine == theirs and mine[0] == ("a.jpg", bytes(size))


def test_header_byte_sum_is_exact():
    """byte_sum (two Adler-32 halves) equals sum() on every kind of header, the extremes included."""
    rng = random.Random(0)
    blocks = [bytes(rng.randrange(256) for _ in range(512)) for _ in range(300)]
    blocks += [b"\xff" * 512, bytes(512), b"\xff" * 256 + bytes(256), bytes(256) + b"\xff" * 256]
    for block in blocks:
        assert byte_sum(block) == sum(block)


@pytest.mark.parametrize("how", READERS)
def test_tar_reader_detects_truncation_and_corrupt_headers(tmp_path, how):
    raw = _tar(tarfile.USTAR_FORMAT, ["a.jpg", "a.cls", "b.jpg", "b.cls"])
    p = tmp_path / "t.tar"
    p.write_bytes(raw[:1800])  # inside the second header (a.jpg: 512 + 1024 bytes)
    with pytest.raises(TarFormatError, match=r"truncated tar header at byte 1536 \(264 of 512"):
        _read_members(p, how)
    p.write_bytes(raw[:2200])  # inside the second member's data
    with pytest.raises(TarFormatError, match="unexpected end of data in member 'a.cls'"):
        _read_members(p, how)
    bad = bytearray(raw)
    bad[1536 + 10] ^= 0xFF  # flip a byte in the second header
    p.write_bytes(bytes(bad))
    with pytest.raises(TarFormatError, match="corrupt tar header at byte 1536"):
        _read_members(p, how)


def test_plain_tar_shards_are_read_into_bytearrays_and_compressed_ones_streamed(tmp_path):
    """shard_members reads a plain tar member by member into bytearrays (which the decoder uses
    without a copy) and streams gzip, zstd and empty files, with the same members either way."""
    import zstandard

    raw = _tar(tarfile.USTAR_FORMAT, ["a.jpg", "a.cls", "b.jpg", "b.cls"])
    files = {"a.tar": raw, "a.tgz": gzip.compress(raw),
             "a.tar.zst": zstandard.ZstdCompressor().compress(raw), "empty.tar": b""}
    (tmp_path / "a.tar").write_bytes(raw)
    expected = _read_members(tmp_path / "a.tar", "stream")
    assert [n for n, _ in expected] == ["a.jpg", "a.cls", "b.jpg", "b.cls"]
    kinds = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with shard_members(str(tmp_path / name)) as members:
            got = list(members)
        kinds[name] = {type(d).__name__ for _, d in got}
        assert [(n, bytes(d)) for n, d in got] == ([] if name == "empty.tar" else expected), name
    assert kinds == {"a.tar": {"bytearray"}, "a.tgz": {"bytes"}, "a.tar.zst": {"bytes"},
                     "empty.tar": set()}
