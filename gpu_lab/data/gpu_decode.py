"""GPU decode for the shard loader (`shard_loader(..., decode="gpu")`).

At the thousands of images per second a large GPU trains a ResNet-50, decoding JPEGs on the host's
cores becomes the wall. With decode="gpu" the work splits in two:

- in each DataLoader worker, `JpegHandover`: read the image's size from its JPEG header (no
  decoding), make the random draws for crop and flip exactly as the CPU path makes them (the
  worker's torch RNG, the same order: `ImageTransform.draw`), and keep the encoded bytes;
  `encoded_batch` then packs a batch's bytes into one shared-memory tensor (one segment per batch,
  whatever the batch size) with their offsets, draws and labels: an `EncodedBatch`;
- in the training process, `BatchDecoder`: decode the whole batch with
  `torchvision.io.decode_jpeg(list_of_tensors, device="cuda")` (nvJPEG) and run the same crop,
  resize and flip (`ImageTransform.apply`) as tensor ops on the device.

For the same draws the result is the CPU path's: bit for bit where both decode on the CPU (the
tests check it), and on a GPU within what two JPEG decoders and two resize kernels differ by
(nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's; CUDA resizes uint8 in float and
rounds). Only JPEG decodes on the GPU, and only the "none" and "basic" augmentations run there:
AutoAugment and RandomErasing stay a CPU (decode="cpu") feature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..config import Augment, Decode
from .transforms import ImageTransform

JPEG_KEYS = ("jpg", "jpeg")
# Start-of-frame markers carry the image size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field.
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD9)])


def gpu_present() -> bool:
    """Whether this process trains on GPUs, decided without touching CUDA (the launcher's device
    kind, else NVML's count): torch.cuda here could initialise CUDA in a notebook kernel."""
    from ..rank.accelerator import device_kind

    return device_kind() == "cuda"


def resolve(decode: str, *, augment: str, train: bool, device: torch.device | None) -> Decode:
    """decode="cpu" | "gpu" | "auto" → Decode.CPU or Decode.GPU, or a ValueError saying why not."""
    try:
        kind = Decode(decode)
    except ValueError:
        raise ValueError(f"decode={decode!r}: expected one of {Decode.choices()}") from None
    if kind is Decode.CPU:
        return kind
    per_image_augment = train and Augment(augment) is Augment.AUTOAUGMENT
    if kind is Decode.AUTO:
        on_gpu = gpu_present() and (device is None or device.type == "cuda")
        return Decode.GPU if on_gpu and not per_image_augment else Decode.CPU
    if not gpu_present():
        raise ValueError("decode='gpu': this host has no GPU (NVML sees none), and the batch "
                         "decoder (nvJPEG) runs on a CUDA device. Use decode='cpu' (the DataLoader "
                         "workers decode) or decode='auto' (the GPU when there is one).")
    if per_image_augment:
        raise ValueError("decode='gpu' with augment='autoaugment': AutoAugment and RandomErasing "
                         "run per image in the DataLoader workers, on decoded images. Use "
                         "augment='basic' (crop + flip, done on the GPU) or decode='cpu'.")
    return kind


def jpeg_size(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) from a JPEG's start-of-frame header, without decoding anything."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        raise ValueError("not a JPEG (no start-of-image marker)")
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise ValueError(f"not a JPEG (no marker at byte {i})")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in _SOF:
            if i + 9 > n:
                break
            return (data[i + 5] << 8 | data[i + 6]), (data[i + 7] << 8 | data[i + 8])
        if marker == 0xDA:  # start of scan: the frame header comes before it or not at all
            break
        i += 2 + (data[i + 2] << 8 | data[i + 3])
    raise ValueError("JPEG without a frame header (truncated?)")


class JpegHandover:
    """Worker side of decode="gpu": a sample's encoded image → (the bytes, the draws for it)."""

    def __init__(self, transform: ImageTransform) -> None:
        self.transform = transform

    def __call__(self, data: bytes | memoryview, ext: str) -> tuple[bytes | memoryview, Any]:
        if ext not in JPEG_KEYS:
            raise ValueError(f"decode='gpu' reads JPEG images only (nvJPEG), this sample's image "
                             f"is .{ext}: write JPEG shards or use decode='cpu'")
        height, width = jpeg_size(data)
        return data, self.transform.draw(height, width)

    def __repr__(self) -> str:
        return f"JpegHandover({self.transform!r})"


@dataclass
class EncodedBatch:
    """A batch as the workers hand it over with decode="gpu": image i is
    `data[offsets[i]:offsets[i + 1]]`, cropped and flipped as `params[i]` says (None: the eval
    transform for every image)."""

    data: torch.Tensor                 # uint8, every image's encoded bytes back to back
    offsets: list[int]                 # len(batch) + 1
    params: list | None                # ImageTransform.draw results, one per image
    labels: torch.Tensor               # int64
    keys: list[str] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def chunks(self) -> list[torch.Tensor]:
        """One 1-D uint8 tensor per image (views of `data`), what decode_jpeg takes."""
        d, o = self.data, self.offsets
        return [d[o[i]:o[i + 1]] for i in range(len(self))]

    def pin_memory(self) -> "EncodedBatch":
        # the DataLoader's pin thread calls this; the decoder reads the host bytes itself
        return self


def encoded_batch(samples: list, return_keys: bool,
                  empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> EncodedBatch:
    """[((bytes, params), label, key), ...] → EncodedBatch, the bytes copied once into `empty`'s
    tensor (shared memory in a DataLoader worker, so the batch crosses without another copy)."""
    offsets = [0]
    for (data, _), _, _ in samples:
        offsets.append(offsets[-1] + len(data))
    out = empty((offsets[-1],), torch.uint8)
    flat = out.numpy()
    for ((data, _), _, _), start, end in zip(samples, offsets, offsets[1:]):
        flat[start:end] = np.frombuffer(data, dtype=np.uint8)
    params = [p for (_, p), _, _ in samples]
    return EncodedBatch(out, offsets, None if params[0] is None else params,
                        torch.tensor([s[1] for s in samples], dtype=torch.long),
                        [s[2] for s in samples] if return_keys else None)


class BatchDecoder:
    """Training-process side of decode="gpu": EncodedBatch → (uint8 images, labels[, keys]) on
    `device`, images decoded as one nvJPEG batch and transformed there."""

    def __init__(self, transform: ImageTransform, device: torch.device) -> None:
        self.transform, self.device = transform, device

    def __call__(self, batch: EncodedBatch) -> tuple:
        from torchvision.io import ImageReadMode, decode_jpeg

        images = decode_jpeg(batch.chunks(), mode=ImageReadMode.RGB, device=self.device)
        size = self.transform.size
        out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device)
        params = batch.params or [None] * len(images)
        for i, (img, p) in enumerate(zip(images, params)):
            out[i] = self.transform.apply(img, p)
        labels = batch.labels.to(out.device, non_blocking=True)
        return (out, labels) if batch.keys is None else (out, labels, batch.keys)

    def __repr__(self) -> str:
        return f"BatchDecoder(device={str(self.device)!r}, {self.transform!r})"


def plan(decode: str, *, transform: Any, augment: str, train: bool,
         device: torch.device | None) -> tuple[JpegHandover, BatchDecoder, torch.device] | None:
    """What shard_loader needs for `decode`: None for CPU decoding, else the worker-side handover,
    the batch decoder and the device it decodes on (default: the current CUDA device)."""
    if resolve(decode, augment=augment, train=train, device=device) is Decode.CPU:
        return None
    target = device if device is not None else torch.device("cuda")
    return JpegHandover(transform), BatchDecoder(transform, target), target


__all__ = ["EncodedBatch", "BatchDecoder", "JpegHandover", "encoded_batch", "jpeg_size", "resolve",
           "plan", "gpu_present", "JPEG_KEYS"]
