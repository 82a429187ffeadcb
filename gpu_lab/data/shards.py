# Long: writing shards, their manifest and finding them again share one format, kept in one file.
"""WebDataset shards on disk: write them from an ImageFolder tree, describe them in a manifest, find them.

Small files are merged into WebDataset shards: a shard is a plain tar file whose
members `<key>.jpg`, `<key>.cls` (and optionally `<key>.json`) form one sample. Reading thousands of
small files costs one open/stat/read round trip each (and on network storage, one request each);
a shard is read sequentially in large blocks, and whole shards are what ranks and workers split.

`write_shards` writes `shard-000000.tar`, `shard-000001.tar`, … (or `.tar.zst` with
`compress="zstd"`) and then `manifest.json`, last: a directory with a manifest is complete. The
manifest records per shard the sample count, the size in bytes and the sha256, and for the whole
set the class names and, for zstd, the compression ratio as measured.

About "Zstandard, 3:1": JPEG and PNG are already entropy-coded, so zstd cannot shrink them. A shard
of small JPEGs still shrinks a little because tar's 512-byte headers and padding compress to almost
nothing: that is most of what `zstd_ratio` (the files' ratio) measures. 3:1 is what text, JSON or
raw tensors may get.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping

from ..units import fmt_bytes

MANIFEST_NAME = "manifest.json"
FORMAT = "gpu_lab.shards/1"
COMPRESSIONS = (None, "zstd")
IMAGE_EXTS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
# 10,000 samples or 256 MiB per shard: large enough that reads are long and sequential, small
# enough that a data set of 100k images has dozens of shards for ranks x workers to split.
DEFAULT_MAXCOUNT = 10_000
DEFAULT_MAXSIZE = 256 * 2**20


@dataclass
class ShardInfo:
    """One shard file."""

    name: str
    count: int
    bytes: int
    sha256: str
    raw_bytes: int  # the uncompressed tar stream; equal to `bytes` when not compressed


@dataclass
class ShardManifest:
    """`manifest.json`: what `write_shards` wrote."""

    num_samples: int
    classes: list[str]
    compression: str | None
    shards: list[ShardInfo] = field(default_factory=list)
    image_bytes: int = 0  # sum of the encoded image payloads
    format: str = FORMAT

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def raw_bytes(self) -> int:
        return sum(s.raw_bytes for s in self.shards)

    @property
    def zstd_ratio(self) -> float | None:
        """Uncompressed tar bytes / compressed shard bytes, measured (None unless zstd)."""
        if self.compression != "zstd" or not self.bytes:
            return None
        return self.raw_bytes / self.bytes

    def counts(self) -> dict[str, int]:
        return {s.name: s.count for s in self.shards}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"], d["raw_bytes"] = self.bytes, self.raw_bytes
        d["zstd_ratio"] = self.zstd_ratio
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ShardManifest":
        if d.get("format") != FORMAT:
            raise ValueError(f"manifest format={d.get('format')!r}: expected {FORMAT!r}")
        return cls(num_samples=d["num_samples"], classes=list(d["classes"]),
                   compression=d["compression"], shards=[ShardInfo(**s) for s in d["shards"]],
                   image_bytes=d.get("image_bytes", 0))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ShardManifest":
        """Read a manifest file, or `<dir>/manifest.json`."""
        p = Path(path)
        if p.is_dir():
            p = p / MANIFEST_NAME
        return cls.from_dict(json.loads(p.read_text()))

    def __repr__(self) -> str:
        z = f", zstd_ratio={self.zstd_ratio:.3f}" if self.zstd_ratio else ""
        return (f"ShardManifest(num_samples={self.num_samples}, shards={len(self.shards)}, "
                f"classes={len(self.classes)}, bytes={self.bytes}, compression={self.compression!r}{z})")


@dataclass
class WriteReport:
    """What `write_shards` returns: the manifest, where it went and how fast it was written."""

    manifest: ShardManifest
    out_dir: Path
    seconds: float

    @property
    def images_per_minute(self) -> float:
        return self.manifest.num_samples / self.seconds * 60.0 if self.seconds > 0 else float("inf")

    @property
    def urls(self) -> list[str]:
        return [str(self.out_dir / s.name) for s in self.manifest.shards]

    def summary(self) -> str:
        m = self.manifest
        lines = [f"{m.num_samples} samples, {len(m.classes)} classes -> {len(m.shards)} shards in "
                 f"{self.out_dir} ({fmt_bytes(m.bytes, 1)}), {self.images_per_minute:,.0f} images/min"]
        if m.compression == "zstd":
            lines.append(f"zstd: shard files {m.zstd_ratio:.3f}:1 (tar headers and padding included)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"WriteReport({self.summary()!r})"


# ---------------------------------------------------------------------------------------- sources

@dataclass
class _Sample:
    key: str
    label: int
    ext: str
    data: bytes
    meta: dict | None


def sniff_image_ext(data: bytes) -> str:
    """'jpg', 'png' or 'webp' from the magic bytes; ValueError otherwise."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    raise ValueError(f"unknown image format (first bytes {data[:8]!r}): expected JPEG, PNG or WebP")


def image_folder_files(root: str | os.PathLike) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(file, label)]) of an ImageFolder tree, in sorted order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"source={str(root)!r}: not a directory (expected an ImageFolder tree "
                                f"<root>/<class>/<image>)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"source={str(root)!r}: no class sub-directories (expected <root>/<class>/<image>)")
    files = []
    for label, name in enumerate(classes):
        for p in sorted((root / name).rglob("*")):
            if p.suffix.lower() in IMAGE_EXTS and p.is_file():
                files.append((p, label))
    if not files:
        raise ValueError(f"source={str(root)!r}: no images with extension {sorted(IMAGE_EXTS)}")
    return classes, files


def _folder_samples(root: Path, files: list[tuple[Path, int]], classes: list[str],
                    include_json: bool) -> Iterator[_Sample]:
    for i, (path, label) in enumerate(files):
        meta = {"path": str(path.relative_to(root)), "class": classes[label]} if include_json else None
        yield _Sample(f"{i:08d}", label, IMAGE_EXTS[path.suffix.lower()], path.read_bytes(), meta)


def _iterable_samples(source: Iterable, include_json: bool) -> Iterator[_Sample]:
    """Samples from dicts ({'__key__'?, 'jpg'|'png'|..., 'cls', 'json'?}) or (image, label) pairs,
    where image is encoded bytes or a file path."""
    for i, item in enumerate(source):
        if isinstance(item, Mapping):
            key = str(item.get("__key__", f"{i:08d}"))
            ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in item), None)
            if ext is None or "cls" not in item:
                raise ValueError(f"sample {i}: keys {sorted(item)}: expected an image under 'jpg', "
                                 f"'jpeg', 'png' or 'webp' and a label under 'cls'")
            data, label, meta = item[ext], int(item["cls"]), item.get("json")
            ext = "jpg" if ext == "jpeg" else ext
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            image, label = item
            key, meta = f"{i:08d}", None
            if isinstance(image, (str, os.PathLike)):
                data = Path(image).read_bytes()
                meta = {"path": str(image)} if include_json else None
            else:
                data = bytes(image)
            ext, label = sniff_image_ext(data), int(label)
        else:
            raise TypeError(f"sample {i}: {type(item).__name__}: expected a dict or an (image, label) pair")
        if "." in key:
            raise ValueError(f"sample {i}: __key__={key!r} contains '.', which WebDataset reads as "
                             f"an extension separator")
        if isinstance(meta, (str, bytes)):
            meta = json.loads(meta)
        yield _Sample(key, label, ext, bytes(data), meta if include_json else None)


# ---------------------------------------------------------------------------------------- writing

class _HashingFile(io.RawIOBase):
    """Write-through wrapper that counts and hashes what reaches the file."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)


class _CountingFile(io.RawIOBase):
    def __init__(self, f) -> None:
        self.f, self.n = f, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        self.f.write(b)
        return len(b)


class _ShardFile:
    """One open shard: a tar stream, optionally through a zstd compressor, hashed at the file."""

    def __init__(self, path: Path, compress: str | None, level: int) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.fh = open(self.tmp, "wb")
        self.hashed = _HashingFile(self.fh)
        self.zw = None
        if compress == "zstd":
            import zstandard

            self.zw = zstandard.ZstdCompressor(level=level).stream_writer(self.hashed, closefd=False)
            self.raw = _CountingFile(self.zw)
        else:
            self.raw = _CountingFile(self.hashed)
        self.tar = tarfile.open(fileobj=self.raw, mode="w|")
        self.count = 0
        self.size = 0  # tar bytes added so far (tarfile buffers, so self.raw.n lags behind)

    def add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0  # mtime 0: byte-identical reruns
        self.tar.addfile(info, io.BytesIO(data))
        self.size += _tar_member_size(len(data))

    def close(self) -> ShardInfo:
        self.tar.close()
        if self.zw is not None:
            self.zw.close()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)
        return ShardInfo(name=self.path.name, count=self.count, bytes=self.hashed.n,
                         sha256=self.hashed.sha.hexdigest(), raw_bytes=self.raw.n)


def _tar_member_size(n: int) -> int:
    return 512 + (n + 511) // 512 * 512


def write_shards(source: str | os.PathLike | Iterable, out_dir: str | os.PathLike,
                 maxcount: int = DEFAULT_MAXCOUNT, maxsize: int = DEFAULT_MAXSIZE,
                 compress: str | None = None, *, prefix: str = "shard", shuffle: bool = True,
                 seed: int = 0, classes: list[str] | None = None, include_json: bool = False,
                 zstd_level: int = 3, progress: bool = True) -> WriteReport:
    """Write WebDataset tar shards (`.jpg`/`.png` + `.cls`, optional `.json`) and a manifest.

    source: an ImageFolder directory (`<root>/<class>/<image>`; class = sorted folder index), or an
        iterable of samples: dicts `{'__key__'?, 'jpg'|'png'|'webp': bytes, 'cls': int, 'json'?}` or
        `(image bytes or path, label)` pairs.
    maxcount / maxsize: start a new shard before either would be exceeded (maxsize counts the
        uncompressed tar bytes, end-of-archive marker included; tar then pads the file to a
        multiple of its 10 KiB record size).
    compress: None or "zstd" (shards `*.tar.zst`; the loader reads both).
    shuffle: shuffle an ImageFolder's file order (with `seed`) before sharding, so that every shard
        holds every class; unshuffled, a shard holds one class and a shuffle buffer cannot mix them.
    include_json: add `<key>.json` with the source path and class name (off by default: a third
        tar member per sample costs 1 KiB of headers and padding and a header parse on every read).

    Returns a `WriteReport` (manifest, out_dir, seconds, images_per_minute, summary()).
    """
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress={compress!r}: expected one of {COMPRESSIONS}")
    if not isinstance(maxcount, int) or maxcount < 1:
        raise ValueError(f"maxcount={maxcount!r}: expected a positive int (samples per shard)")
    if not isinstance(maxsize, int) or maxsize < 4096:
        raise ValueError(f"maxsize={maxsize!r}: expected an int >= 4096 (bytes per shard)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob(f"{prefix}-*.tar*")):
        raise FileExistsError(f"out_dir={str(out)!r} already holds {prefix}-*.tar shards; write to an "
                              f"empty directory (old and new shards would mix)")
    samples, total, classes = _samples_of(source, shuffle, seed, classes, include_json)
    ext = ".tar.zst" if compress == "zstd" else ".tar"
    from tqdm import tqdm  # plain tqdm: data code never imports ipywidgets (tqdm.auto would)

    t0 = time.perf_counter()
    with tqdm(total=total, desc="write_shards", unit="img", disable=not progress) as bar:
        shards, n, labels_seen, image_bytes = _fill_shards(
            samples, lambda i: _ShardFile(out / f"{prefix}-{i:06d}{ext}", compress, zstd_level),
            maxcount, maxsize, bar.update)
    if n == 0:
        raise ValueError("source yielded no samples")
    if classes is None:
        classes = [str(i) for i in range(max(labels_seen) + 1)]
    manifest = ShardManifest(num_samples=n, classes=list(classes), compression=compress,
                             shards=shards, image_bytes=image_bytes)
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, out / MANIFEST_NAME)  # written last: a manifest means the set is complete
    return WriteReport(manifest=manifest, out_dir=out, seconds=time.perf_counter() - t0)


def _samples_of(source, shuffle: bool, seed: int, classes: list[str] | None, include_json: bool):
    """(samples, how many or None, class names or None) of write_shards' `source`."""
    if not isinstance(source, (str, os.PathLike)):
        return (_iterable_samples(source, include_json),
                len(source) if hasattr(source, "__len__") else None, classes)
    root = Path(source)
    classes_found, files = image_folder_files(root)
    if shuffle:
        random.Random(seed).shuffle(files)
    return (_folder_samples(root, files, classes_found, include_json), len(files),
            classes or classes_found)


def _fill_shards(samples: Iterable[_Sample], new_shard, maxcount: int, maxsize: int, tick):
    """Every sample into shards `new_shard(0)`, `new_shard(1)`, ...; returns (the shards' infos,
    samples written, labels seen, image bytes)."""
    shards: list[ShardInfo] = []
    labels_seen: set[int] = set()
    image_bytes, n = 0, 0
    current: _ShardFile | None = None
    for s in samples:
        members = [(f"{s.key}.{s.ext}", s.data), (f"{s.key}.cls", str(s.label).encode())]
        if s.meta is not None:
            members.append((f"{s.key}.json", json.dumps(s.meta, sort_keys=True).encode()))
        size = sum(_tar_member_size(len(d)) for _, d in members)
        if current is not None and (current.count >= maxcount or
                                    (current.count > 0 and current.size + size + 1024 > maxsize)):
            shards.append(current.close())
            current = None
        if current is None:
            current = new_shard(len(shards))
        for name, data in members:
            current.add(name, data)
        current.count += 1
        n += 1
        labels_seen.add(s.label)
        image_bytes += len(s.data)
        tick()
    if current is not None:
        shards.append(current.close())
    return shards, n, labels_seen, image_bytes


# ---------------------------------------------------------------------------------------- reading

def resolve_shards(urls: str | os.PathLike | list) -> tuple[list[str], ShardManifest | None]:
    """Shard paths and the manifest (when there is one) from what a user may pass:

    a directory (its manifest, or every `*.tar`, `*.tar.zst`, `*.tgz`, `*.tar.gz` in it), a
    manifest file, one shard file, a brace pattern (`data/shard-{000000..000009}.tar`), or a list
    of shard paths.
    """
    if isinstance(urls, (list, tuple)):
        out = [str(u) for u in urls]
        if not out:
            raise ValueError("urls=[]: expected at least one shard")
        return out, _manifest_beside(out)
    s = str(urls)
    p = Path(s)
    if p.is_dir():
        if (p / MANIFEST_NAME).exists():
            m = ShardManifest.load(p)
            return [str(p / sh.name) for sh in m.shards], m
        found = sorted(str(f) for pat in ("*.tar", "*.tar.zst", "*.tgz", "*.tar.gz") for f in p.glob(pat))
        if not found:
            raise FileNotFoundError(f"urls={s!r}: directory holds no {MANIFEST_NAME} and no "
                                    f"*.tar / *.tar.zst / *.tgz shards")
        return found, None
    if p.name.endswith(".json") and p.is_file():
        m = ShardManifest.load(p)
        return [str(p.parent / sh.name) for sh in m.shards], m
    import braceexpand

    out = list(braceexpand.braceexpand(s))
    return out, _manifest_beside(out)


def _manifest_beside(paths: list[str]) -> ShardManifest | None:
    """The manifest in the shards' directory, if every shard is listed in it."""
    parents = {Path(p).parent for p in paths}
    if len(parents) != 1:
        return None
    mpath = parents.pop() / MANIFEST_NAME
    if not mpath.exists():
        return None
    try:
        m = ShardManifest.load(mpath)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
    names = {s.name for s in m.shards}
    return m if all(Path(p).name in names for p in paths) else None


def verify_shards(out_dir: str | os.PathLike) -> list[str]:
    """Re-hash every shard listed in the manifest; the names of those that are missing or differ."""
    out = Path(out_dir)
    m = ShardManifest.load(out)
    bad = []
    for s in m.shards:
        p = out / s.name
        if not p.exists():
            bad.append(s.name)
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != s.sha256:
            bad.append(s.name)
    return bad
