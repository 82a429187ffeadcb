"""Synthetic image classification data that a model can learn on a CPU in minutes.

No data set can be downloaded on the machines gpu_lab targets in its tests and tutorials, so it makes
its own. Every class is a (shape, colour, texture) combination drawn at a random position, size,
rotation and brightness over a noisy, randomly tinted background: structure, not noise, so accuracy
visibly rises within a few hundred steps of a tiny CNN.

Image `i` of a data set depends only on `(seed, i)`, so the files, the in-memory dataset and every
DataLoader worker agree, whatever the order of generation.

Two forms of the same images:

- `make_synthetic_images(out_dir, n, ...)` writes JPEG (or PNG) files in ImageFolder layout
  (`out_dir/<class name>/<index>.jpg`), the input of `write_shards` and of the loader benchmark;
- `SyntheticImages(n, ...)` renders tensors on the fly (about 0.1 ms for a 32 px image), for quick CPU
  runs and tutorials that need no files at all.

Both take `class_ids`, a subset of the full class list to use as the data set's classes: with
`TEXTURE_CLASSES` (one shape and colour, three textures) the classes differ only in a pattern a few
pixels wide, so an input too small to show it cannot tell them apart, which is what an input-size
experiment needs. `SyntheticImages(render_size=...)` draws each image at that size and downsamples it
(area average) to `image_size`, as a camera image is downsampled to a network's input.
"""
from __future__ import annotations

import colorsys
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from torch.utils.data import Dataset

SHAPES = ("disk", "square", "triangle", "ring", "cross", "diamond", "crescent", "bars")
COLOURS = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "magenta", "white")
TEXTURES = ("solid", "stripes", "dots", "checker")
# 8 and 9 are coprime, so classes 0..71 all have a distinct (shape, colour) pair; the texture
# separates the next blocks of 72.
MAX_CLASSES = len(SHAPES) * len(COLOURS) * len(TEXTURES)
# A red disk with stripes, with dots, with checks: told apart by texture alone (the period of the
# pattern is about a tenth of the image side, so below about 24 px it averages away).
TEXTURE_CLASSES = (72, 144, 216)
IMAGE_FORMATS = ("jpg", "png")

# Hue in degrees of each colour name; "white" is drawn unsaturated.
_HUES = {"red": 0, "orange": 30, "yellow": 58, "green": 120, "cyan": 180, "blue": 225,
         "purple": 270, "magenta": 310, "white": 0}


def class_spec(label: int) -> tuple[str, str, str]:
    """(shape, colour, texture) of class `label`."""
    return (SHAPES[label % len(SHAPES)], COLOURS[label % len(COLOURS)],
            TEXTURES[(label // (len(SHAPES) * len(COLOURS))) % len(TEXTURES)])


def class_names(num_classes: int) -> list[str]:
    """Folder names, in label order (zero-padded, so ImageFolder's sorted order is label order)."""
    _check_num_classes(num_classes)
    return _names(list(range(num_classes)))


def _class_ids(num_classes: int, class_ids) -> list[int]:
    """The full-list class of each label: 0..num_classes-1, or `class_ids` (checked)."""
    if class_ids is None:
        _check_num_classes(num_classes)
        return list(range(num_classes))
    ids = list(class_ids)
    if (len(ids) < 2 or len(set(ids)) != len(ids)
            or not all(isinstance(c, int) and 0 <= c < MAX_CLASSES for c in ids)):
        raise ValueError(f"class_ids={class_ids!r}: expected at least 2 distinct ints in "
                         f"[0, {MAX_CLASSES})")
    if num_classes != len(ids):
        raise ValueError(f"num_classes={num_classes!r} but class_ids has {len(ids)} classes: pass "
                         f"num_classes=len(class_ids)")
    return ids


def _names(ids: list[int]) -> list[str]:
    """Folder names of labels 0..len(ids)-1 (zero-padded by label, so sorted order is label order)."""
    names = []
    for k, c in enumerate(ids):
        shape, colour, texture = class_spec(c)
        names.append(f"{k:03d}_{colour}_{shape}" + ("" if texture == "solid" else f"_{texture}"))
    return names


def _check_num_classes(num_classes: int) -> None:
    if not isinstance(num_classes, int) or not 2 <= num_classes <= MAX_CLASSES:
        raise ValueError(f"num_classes={num_classes!r}: expected an int in [2, {MAX_CLASSES}] "
                         f"({len(SHAPES)} shapes x {len(COLOURS)} colours x {len(TEXTURES)} textures)")


def _check_image_size(image_size: int) -> None:
    if not isinstance(image_size, int) or not 8 <= image_size <= 1024:
        raise ValueError(f"image_size={image_size!r}: expected an int in [8, 1024] pixels")


def _rgb(colour: str, rng: np.random.Generator) -> np.ndarray:
    if colour == "white":
        v = rng.uniform(0.85, 1.0)
        return np.array([v, v, v]) * 255.0
    hue = (_HUES[colour] + rng.uniform(-8, 8)) % 360
    r, g, b = colorsys.hsv_to_rgb(hue / 360.0, rng.uniform(0.75, 1.0), rng.uniform(0.75, 1.0))
    return np.array([r, g, b]) * 255.0


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of `shape` in rotated, radius-normalised coordinates (u, v)."""
    if shape == "disk":
        return u * u + v * v < 1.0
    if shape == "ring":
        r2 = u * u + v * v
        return (r2 < 1.0) & (r2 > 0.36)
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) < 0.78
    if shape == "diamond":
        return np.abs(u) + np.abs(v) < 1.0
    if shape == "triangle":
        # equilateral, apex up: three half-planes
        s3 = math.sqrt(3.0)
        return (v < 0.5) & (s3 * u - v < 1.0) & (-s3 * u - v < 1.0)
    if shape == "cross":
        return ((np.abs(u) < 0.3) & (np.abs(v) < 1.0)) | ((np.abs(v) < 0.3) & (np.abs(u) < 1.0))
    if shape == "crescent":
        return (u * u + v * v < 1.0) & ((u - 0.45) ** 2 + v * v > 0.6)
    if shape == "bars":
        return (np.abs(u) < 0.95) & (np.abs(v) < 0.95) & (np.cos(v * 2.5 * math.pi) > 0.2)
    raise ValueError(f"shape={shape!r}: expected one of {SHAPES}")


def _texture(texture: str, u: np.ndarray, v: np.ndarray, phase: float) -> np.ndarray:
    """Brightness multiplier in [0.45, 1] for the foreground."""
    if texture == "solid":
        return np.ones_like(u)
    if texture == "stripes":
        return 0.725 + 0.275 * np.sign(np.sin(u * 4.0 * math.pi + phase))
    if texture == "dots":
        return np.where(np.sin(u * 3.5 * math.pi + phase) * np.sin(v * 3.5 * math.pi) > 0.35, 0.45, 1.0)
    if texture == "checker":
        return 0.725 + 0.275 * np.sign(np.sin(u * 2.5 * math.pi + phase) * np.sin(v * 2.5 * math.pi))
    raise ValueError(f"texture={texture!r}: expected one of {TEXTURES}")


def render(index: int, label: int, image_size: int, seed: int) -> np.ndarray:
    """Image `index` (of class `label`) as a uint8 HxWx3 array; a pure function of its arguments."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index, 0x5EED])
    shape, colour, texture = class_spec(label)
    n = image_size
    coords = (np.arange(n, dtype=np.float32) + 0.5) / n * 2.0 - 1.0
    y, x = np.meshgrid(coords, coords, indexing="ij")

    # background: a random low-saturation tint with a linear gradient, so colour alone is not the
    # class and the model has to look at the object.
    bg_hue = rng.uniform(0, 1)
    bg = np.array(colorsys.hsv_to_rgb(bg_hue, rng.uniform(0.0, 0.35), rng.uniform(0.15, 0.55))) * 255
    angle = rng.uniform(0, 2 * math.pi)
    grad = (x * math.cos(angle) + y * math.sin(angle))[..., None] * rng.uniform(0, 40)
    img = bg[None, None, :] + grad

    # the object: random centre, radius and rotation
    cx, cy = rng.uniform(-0.3, 0.3, size=2)
    radius = rng.uniform(0.38, 0.62)
    theta = rng.uniform(0, 2 * math.pi)
    c, s = math.cos(theta), math.sin(theta)
    u = ((x - cx) * c + (y - cy) * s) / radius
    v = (-(x - cx) * s + (y - cy) * c) / radius
    mask = _shape_mask(shape, u, v)
    fg = _rgb(colour, rng)[None, None, :] * _texture(texture, u, v, rng.uniform(0, 2 * math.pi))[..., None]
    img = np.where(mask[..., None], fg, img)

    img += rng.normal(0.0, 6.0, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def labels_for(n: int, num_classes: int) -> list[int]:
    """Balanced labels: image i has class i % num_classes."""
    return [i % num_classes for i in range(n)]


@dataclass
class SyntheticImageSet:
    """What `make_synthetic_images` wrote."""

    root: Path
    n: int
    image_size: int
    num_classes: int
    seed: int
    fmt: str
    classes: list[str] = field(default_factory=list)
    bytes_written: int = 0

    def __repr__(self) -> str:  # deterministic: no addresses, notebooks diff cleanly
        return (f"SyntheticImageSet(root='{self.root}', n={self.n}, image_size={self.image_size}, "
                f"num_classes={self.num_classes}, fmt='{self.fmt}', bytes={self.bytes_written})")


def make_synthetic_images(out_dir: str | os.PathLike, n: int, image_size: int = 64,
                          num_classes: int = 10, seed: int = 0, fmt: str = "jpg",
                          quality: int = 90, progress: bool = False,
                          class_ids=None) -> SyntheticImageSet:
    """Write `n` images in ImageFolder layout: `out_dir/<class name>/<index:07d>.<fmt>`.

    Deterministic: the same (n, image_size, num_classes, seed, fmt, quality) gives byte-identical
    files. Classes are balanced (image i has class i % num_classes). Files already in `out_dir`
    with the same names are overwritten; others are left alone. `class_ids` (see the module
    docstring) picks the classes; num_classes must then be len(class_ids).
    """
    from PIL import Image

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: expected a positive int (number of images)")
    _check_image_size(image_size)
    ids = _class_ids(num_classes, class_ids)
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {IMAGE_FORMATS}")
    root = Path(out_dir)
    names = _names(ids)
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="synthetic images", unit="img")
    total = 0
    for i, label in enumerate(labels_for(n, num_classes)):
        path = root / names[label] / f"{i:07d}.{fmt}"
        img = Image.fromarray(render(i, ids[label], image_size, seed))
        if fmt == "jpg":
            img.save(path, format="JPEG", quality=quality)
        else:
            img.save(path, format="PNG")
        total += path.stat().st_size
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return SyntheticImageSet(root=root, n=n, image_size=image_size, num_classes=num_classes,
                             seed=seed, fmt=fmt, classes=names, bytes_written=total)


class SyntheticImages(Dataset):
    """The same images as `make_synthetic_images`, rendered on the fly as tensors (no files).

    `ds[i]` is `(image, label)`: a float32 tensor of shape (3, image_size, image_size) in [0, 1]
    (passed through `transform` if one is given) and an int. Works with any number of DataLoader
    workers: item i depends only on (seed, i). `class_ids` and `render_size` (at least
    image_size): see the module docstring.
    """

    def __init__(self, n: int, image_size: int = 32, num_classes: int = 10, seed: int = 0,
                 transform: Callable | None = None, class_ids=None,
                 render_size: int | None = None) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: expected a positive int (number of images)")
        _check_image_size(image_size)
        self.ids = _class_ids(num_classes, class_ids)
        if render_size is not None:
            _check_image_size(render_size)
            if render_size < image_size:
                raise ValueError(f"render_size={render_size!r}: expected at least image_size="
                                 f"{image_size} (images are drawn large, then downsampled)")
        self.n, self.image_size, self.num_classes, self.seed = n, image_size, num_classes, seed
        self.render_size = render_size
        self.transform = transform
        self.classes = _names(self.ids)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import torch

        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} out of range for SyntheticImages of length {self.n}")
        index %= self.n
        label = index % self.num_classes
        arr = render(index, self.ids[label], self.render_size or self.image_size, self.seed)
        if self.render_size not in (None, self.image_size):
            from PIL import Image

            # BOX = the mean of the pixels each output pixel covers: detail finer than a pixel
            # averages out instead of aliasing
            arr = np.array(Image.fromarray(arr).resize((self.image_size,) * 2, Image.BOX))
        img = torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)
        if self.transform is not None:
            img = self.transform(img)
        return img, label

    def __repr__(self) -> str:
        extra = "" if self.ids == list(range(self.num_classes)) else f", class_ids={self.ids}"
        extra += f", render_size={self.render_size}" if self.render_size else ""
        return (f"SyntheticImages(n={self.n}, image_size={self.image_size}, "
                f"num_classes={self.num_classes}, seed={self.seed}{extra})")
