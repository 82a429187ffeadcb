"""Decoding and augmentation: encoded bytes → normalised float tensors, with torchvision.transforms.v2.

The loader decodes with `torchvision.io.decode_image` (libjpeg-turbo / libpng straight into a uint8
CHW tensor) and runs the v2 transforms on uint8 tensors, a faster path per core than PIL decode +
PIL transforms + ToTensor (`gpu-lab bench loader` measures both): decoding and augmenting, not
reading files, bound a loader on a warm disk, so the per-sample path is what to make cheap. For decoded uint8 tensors, "none" and "basic" take `ImageTransform`'s functional path: the
same operations and random draws as the v2 pipeline at about half its per-image cost.

Augmentation levels (for ImageNet-style training, ``autoaugment`` is the strong recipe):

- ``none``: resize the shorter side to `image_size`, centre crop (the eval transform);
- ``basic``: RandomResizedCrop + horizontal flip;
- ``autoaugment``: basic + AutoAugment (ImageNet policy) + RandomErasing.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ..config import Augment

# ImageNet statistics: what pretrained torchvision models expect, and harmless for the rest.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# The smallest crop RandomResizedCrop takes, as a fraction of the image area. torchvision's default
# 0.08 is tuned for ImageNet's large photos; on small images with one object it crops the object
# away often enough to slow learning down, so gpu_lab's default is 0.25.
CROP_SCALE = (0.25, 1.0)
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "ppm")


def check_augment(augment: str) -> Augment:
    try:
        return Augment(augment)
    except ValueError:
        raise ValueError(f"augment={augment!r}: expected one of {Augment.choices()}") from None


def decode(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """Encoded JPEG/PNG/WebP bytes → uint8 tensor (3, H, W), RGB (grey and RGBA are converted)."""
    from torchvision.io import ImageReadMode, decode_image

    # a bytearray (what the shard reader fills) is used as it is; anything else is copied into one
    buf = torch.frombuffer(data if type(data) is bytearray else bytearray(data), dtype=torch.uint8)
    return decode_image(buf, mode=ImageReadMode.RGB)


def build_transform(train: bool, image_size: int, augment: str = "basic",
                    crop_scale: tuple[float, float] = CROP_SCALE, normalize: bool = True) -> Callable:
    """The v2 pipeline for one image: uint8 (3, H, W) tensor (or PIL image) → (3, S, S).

    With `normalize=True` the result is a normalised float32 tensor (handy for a map-style dataset).
    The shard loader passes `normalize=False`, keeps every per-sample step on uint8 and normalises
    whole batches at once with `normalize_batch`: one fused pass per batch instead of two
    per-sample float ops, about a fifth of the per-image CPU time on small images.
    `train=False` always gives the deterministic eval transform, whatever `augment` says.
    """
    aug = check_augment(augment)
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size={image_size!r}: expected a positive int (pixels)")
    # every per-sample step on uint8, whatever comes in (SyntheticImages yields float in [0, 1]):
    # RandomErasing's fill below is on the 0-255 scale, and uint8 ops are the cheaper ones
    ops: list = [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True)]
    if not train or aug is Augment.NONE:
        ops += [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    else:
        ops += [v2.RandomResizedCrop(image_size, scale=crop_scale, antialias=True),
                v2.RandomHorizontalFlip()]
        if aug is Augment.AUTOAUGMENT:
            # erased patches get the mean colour, i.e. 0 after normalisation
            ops += [v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
                    v2.RandomErasing(p=0.25, value=[round(255 * m) for m in MEAN])]
    if normalize:
        ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    if aug is Augment.AUTOAUGMENT and train:
        return v2.Compose(ops)
    return ImageTransform(v2.Compose(ops), train and aug is Augment.BASIC, image_size, crop_scale,
                          normalize)


class ImageTransform:
    """`build_transform`'s result for augment "none" and "basic": a plain uint8 (3, H, W) tensor —
    what the loader's decoder yields — takes a functional path with the same operations and the same
    sampling as the v2 pipeline (RandomResizedCrop: area in `crop_scale`, aspect ratio 3/4 to 4/3,
    ten tries, then a centre crop; flip with p=0.5), at about half the per-image CPU: on small
    images v2's Transform machinery (tv_tensor wrapping, pytree flattening, parameter dicts) costs
    more than the crop itself. Anything else (PIL images, float tensors) goes through `v2`."""

    _LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))

    def __init__(self, v2_pipeline: Callable, random_crop: bool, image_size: int,
                 crop_scale: tuple[float, float], normalize: bool) -> None:
        self.v2 = v2_pipeline
        self.random_crop, self.size, self.scale = random_crop, image_size, crop_scale
        self.normalize = normalize

    def crop_params(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, h, w) exactly as v2.RandomResizedCrop draws them (torch's RNG)."""
        area = height * width
        lo, hi = self.scale
        for _ in range(10):
            u_area, u_ratio = torch.rand(2).tolist()
            target = area * (lo + (hi - lo) * u_area)
            ratio = math.exp(self._LOG_RATIO[0] + (self._LOG_RATIO[1] - self._LOG_RATIO[0]) * u_ratio)
            w = int(round(math.sqrt(target * ratio)))
            h = int(round(math.sqrt(target / ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)))
                left = int(torch.randint(0, width - w + 1, size=(1,)))
                return top, left, h, w
        in_ratio = width / height  # fallback: the largest centre crop within the ratio range
        if in_ratio < 3 / 4:
            w, h = width, int(round(width / (3 / 4)))
        elif in_ratio > 4 / 3:
            h, w = height, int(round(height * (4 / 3)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def draw(self, height: int, width: int) -> tuple[int, int, int, int, bool] | None:
        """The random draws for one image of this size, in the order `__call__` makes them:
        (top, left, h, w, flip), or None when nothing is random (the eval transform). The GPU
        decode path draws them in the DataLoader worker from the JPEG header's size, before any
        decoding, and `apply`s them on the device."""
        if not self.random_crop:
            return None
        top, left, h, w = self.crop_params(height, width)
        return top, left, h, w, float(torch.rand(1)) < 0.5

    def apply(self, img: torch.Tensor,
              params: tuple[int, int, int, int, bool] | None) -> torch.Tensor:
        """Crop, resize and flip a uint8 (3, H, W) tensor, on whatever device it lives, as `params`
        (from `draw`) say; None: resize the shorter side and centre crop."""
        size = [self.size, self.size]
        if params is not None:
            top, left, h, w, flip = params
            out = F.resized_crop_image(img, top, left, h, w, size, antialias=True)
            if flip:
                out = out.flip(-1)
        else:
            out = F.center_crop_image(F.resize_image(img, [self.size], antialias=True), size)
        if self.normalize:
            out = F.normalize_image(out.to(torch.float32).div_(255.0), MEAN, STD)
        return out

    def __call__(self, img):
        if type(img) is not torch.Tensor or img.dtype != torch.uint8 or img.ndim != 3:
            return self.v2(img)
        return self.apply(img, self.draw(img.shape[-2], img.shape[-1]))

    def __repr__(self) -> str:
        return (f"ImageTransform(random_crop={self.random_crop}, size={self.size}, scale={self.scale}, "
                f"normalize={self.normalize}; else {self.v2!r})")


_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD]).view(1, 3, 1, 1)
_BIAS = torch.tensor([-m / s for m, s in zip(MEAN, STD)]).view(1, 3, 1, 1)
_ON_DEVICE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def normalize_batch(batch: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (B, 3, H, W) → float32 (x / 255 - MEAN) / STD (one fused addcmul on a GPU).

    Works on any device: the shard loader calls it after moving a uint8 batch to its `device`
    (a quarter of the bytes over PCIe); with `output="uint8"` call it yourself.
    """
    if batch.device.type == "cpu":
        # on a CPU, convert-then-scale (three vectorised passes) is 2.4x faster than the fused
        # mixed-dtype addcmul below (measured on 64 x 3 x 128 x 128, one thread)
        out = batch.to(torch.float32, copy=True) if out is None else out.copy_(batch)
        return out.mul_(_SCALE).add_(_BIAS)
    key = str(batch.device)  # the constants go to the device once, not once per batch
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (_SCALE.to(batch.device), _BIAS.to(batch.device))
    scale, bias = _ON_DEVICE[key]
    if out is None:
        out = torch.empty(batch.shape, dtype=torch.float32, device=batch.device)
    return torch.addcmul(bias, batch, scale, out=out)


def build_pil_transform(train: bool, image_size: int, augment: str = "basic",
                        crop_scale: tuple[float, float] = CROP_SCALE) -> Callable:
    """The same operations with classic `torchvision.transforms` on PIL images, ending in
    ToTensor: the usual per-file pipeline. Only the loader benchmark's baseline uses it."""
    from torchvision import transforms as T

    aug = check_augment(augment)
    ops: list = []
    if not train or aug is Augment.NONE:
        ops += [T.Resize(image_size), T.CenterCrop(image_size)]
    else:
        ops += [T.RandomResizedCrop(image_size, scale=crop_scale), T.RandomHorizontalFlip()]
        if aug is Augment.AUTOAUGMENT:
            ops.append(T.AutoAugment(T.AutoAugmentPolicy.IMAGENET))
    ops += [T.ToTensor(), T.Normalize(MEAN, STD)]
    if train and aug is Augment.AUTOAUGMENT:
        ops.append(T.RandomErasing(p=0.25))
    return T.Compose(ops)


def image_key(sample: dict) -> str | None:
    """The first key of `sample` that holds an encoded image, or None."""
    for k in IMAGE_KEYS:
        if k in sample:
            return k
    return None


def parse_label(raw: bytes | str | int) -> int:
    """A `.cls` payload (ASCII digits, as WebDataset writes it) → int."""
    if isinstance(raw, int):
        return raw
    return int(raw)  # int() takes ASCII digits as bytes too, and ignores surrounding whitespace
