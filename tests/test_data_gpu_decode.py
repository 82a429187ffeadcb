"""shard_loader(decode="gpu"): workers hand over encoded JPEG bytes and the crop/flip draws, the
training process decodes the batch and transforms it on the device.

This host has no GPU, so `gpu_decode.gpu_present` is replaced by a double that says there is one,
and the batch decoder runs on CPU tensors (torchvision.io.decode_jpeg takes device="cpu" as well).
Everything else is the real path: real shards, real DataLoader workers, the real decoder. On the
CPU both paths decode with libjpeg-turbo and resize with the same kernel, so for the same draws
the batches must be identical, bit for bit; bench/gpu_check.py compares the CUDA path on a GPU.
"""
from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_lab.config import TrainConfig
from gpu_lab.data import ShardError, gpu_decode, shard_loader, write_shards
from gpu_lab.data.gpu_decode import EncodedBatch, jpeg_size
from gpu_lab.train.classifier import datasets
from gpu_lab.train.validate import ConfigError, validate

# Sizes that exercise the crop's paths: square, portrait, landscape, and aspect ratios beyond
# 3/4..4/3 that push RandomResizedCrop into its centre-crop fallback on some draws.
SIZES = [(40, 40), (37, 53), (64, 41), (23, 90), (90, 21), (33, 35)]


def _jpeg(h: int, w: int, seed: int, **save) -> bytes:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    arr = np.clip(ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """60 JPEGs of mixed sizes in 5 shards."""
    samples = [{"__key__": f"{i:04d}", "jpg": _jpeg(*SIZES[i % len(SIZES)], seed=i), "cls": i % 3}
               for i in range(60)]
    out = tmp_path_factory.mktemp("gpu_decode") / "s"
    write_shards(samples, out, maxcount=12, shuffle=False, progress=False)
    return out


@pytest.fixture
def gpu_double(monkeypatch):
    """Stands in for NVML's answer only: "this host trains on a GPU"."""
    monkeypatch.setattr(gpu_decode, "gpu_present", lambda: True)


def _encoded_members(shard_dir: Path) -> dict[str, bytes]:
    out = {}
    for tar in sorted(shard_dir.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                if m.name.endswith(".jpg"):
                    out[m.name.split(".")[0]] = t.extractfile(m).read()
    return out


def _by_key(loader) -> dict[str, tuple[torch.Tensor, int]]:
    out = {}
    for images, labels, keys in loader:
        for img, label, key in zip(images, labels.tolist(), keys):
            out[key] = (img.clone(), label)
    return out


# ------------------------------------------------------------------------------------ refusals

def test_gpu_decode_is_refused_on_a_cpu_host_and_auto_decodes_on_the_cpu(shards):
    with pytest.raises(ValueError, match=r"decode='gpu': this host has no GPU .*decode='cpu'"):
        shard_loader(shards, 8, decode="gpu", rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"decode='nvjpeg': expected one of \['cpu', 'gpu', "
                                         r"'auto'\]"):
        shard_loader(shards, 8, decode="nvjpeg", rank=0, world_size=1)
    auto = shard_loader(shards, 8, decode="auto", image_size=16, num_workers=0, rank=0,
                        world_size=1, output="uint8")
    assert auto.decoder is None and auto.dataset.handover is None
    images, labels = next(iter(auto))
    assert images.shape == (8, 3, 16, 16) and images.dtype == torch.uint8

    # the config field: refused before any process starts, with the field named
    with pytest.raises(ConfigError, match=r"TrainConfig\.decode: got 'gpu', but this host has "
                                          r"no GPU"):
        validate(TrainConfig(decode="gpu"), gpu_count=0)
    with pytest.raises(ValueError, match=r"TrainConfig\.decode: got 'GPU'; accepted: 'cpu', "
                                         r"'gpu', 'auto'"):
        TrainConfig(decode="GPU")
    assert validate(TrainConfig(decode="auto"), gpu_count=0).decode == "auto"
    # and it reaches the shard loader that train_classifier builds
    with pytest.raises(ValueError, match="decode='gpu': this host has no GPU"):
        datasets(TrainConfig(decode="gpu", data_dir=str(shards), num_workers=0))
    train, _ = datasets(TrainConfig(decode="auto", data_dir=str(shards), num_workers=0))
    assert train.decoder is None


def test_autoaugment_stays_on_the_cpu(shards, gpu_double):
    with pytest.raises(ValueError, match="decode='gpu' with augment='autoaugment'"):
        shard_loader(shards, 8, decode="gpu", augment="autoaugment", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="TrainConfig.decode: got 'gpu' with "
                                          "augment='autoaugment'"):
        validate(TrainConfig(decode="gpu", augment="autoaugment"), gpu_count=1)
    assert shard_loader(shards, 8, decode="auto", augment="autoaugment", rank=0,
                        world_size=1).decoder is None
    assert shard_loader(shards, 8, decode="auto", rank=0, world_size=1).decoder is not None
    # auto decodes on the GPU only when the batches go to one
    assert shard_loader(shards, 8, decode="auto", rank=0, world_size=1,
                        device="cpu").decoder is None
    # the eval loader has no per-image augmentation: it decodes on the device
    assert shard_loader(shards, 8, train=False, decode="gpu", augment="autoaugment", rank=0,
                        world_size=1, device="cpu").decoder is not None


# ---------------------------------------------------------------------------- the JPEG header

@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"subsampling": 0}],
                         ids=["baseline", "progressive", "444"])
def test_jpeg_size_reads_the_frame_header(save):
    for i, (h, w) in enumerate(SIZES + [(1, 1), (300, 7)]):
        data = _jpeg(h, w, seed=i, **save)
        assert jpeg_size(data) == (h, w)
        assert jpeg_size(memoryview(data)) == (h, w)
    grey = io.BytesIO()
    Image.new("L", (29, 17), 128).save(grey, format="JPEG")
    assert jpeg_size(grey.getvalue()) == (17, 29)
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    with pytest.raises(ValueError, match="not a JPEG"):
        jpeg_size(png.getvalue())
    with pytest.raises(ValueError, match="without a frame header"):
        jpeg_size(_jpeg(20, 20, seed=0)[:30])


# ----------------------------------------------------------------------------------- hand-over

def test_workers_hand_over_the_encoded_bytes_in_one_shared_segment(shards, gpu_double):
    loader = shard_loader(shards, 8, decode="gpu", device="cpu", image_size=16, num_workers=2,
                          rank=0, world_size=1, return_keys=True, seed=5)
    originals = _encoded_members(shards)
    seen = []
    for batch in loader._loader:  # what crosses from the worker processes, before decoding
        assert isinstance(batch, EncodedBatch)
        assert batch.data.dtype == torch.uint8 and batch.data.is_shared()
        assert len(batch.keys) == len(batch.params) == len(batch.labels) == len(batch)
        for key, chunk, params in zip(batch.keys, batch.chunks(), batch.params):
            assert chunk.numpy().tobytes() == originals[key]  # the encoded bytes, untouched
            top, left, h, w, flip = params
            ih, iw = jpeg_size(originals[key])
            assert 0 <= top <= ih - h and 0 <= left <= iw - w and isinstance(flip, bool)
        seen += batch.keys
    assert sorted(seen) == sorted(originals)
    evaluation = shard_loader(shards, 8, train=False, decode="gpu", device="cpu", num_workers=0,
                              rank=0, world_size=1)
    assert next(iter(evaluation._loader)).params is None  # nothing random to draw


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_device_side_transforms_equal_the_cpu_path_for_the_same_draws(shards, gpu_double,
                                                                      num_workers, train):
    kw = dict(train=train, image_size=24, num_workers=num_workers, rank=0, world_size=1,
              return_keys=True, output="uint8", seed=11)
    torch.manual_seed(0)  # in-process (0 workers) the draws come from this process's RNG
    cpu = _by_key(shard_loader(shards, 8, **kw))
    torch.manual_seed(0)
    gpu_loader = shard_loader(shards, 8, decode="gpu", device="cpu", **kw)
    assert gpu_loader.decoder is not None
    on_device = _by_key(gpu_loader)
    assert sorted(cpu) == sorted(on_device) and len(cpu) == 60
    flips = 0
    for key, (img, label) in cpu.items():
        other, other_label = on_device[key]
        assert label == other_label
        assert other.shape == (3, 24, 24) and other.dtype == torch.uint8
        assert torch.equal(img, other), f"{key}: |diff| {(img.int() - other.int()).abs().max()}"
        flips += int(torch.equal(img, img.flip(-1)))
    # float32 output: normalised after the decode, as on the CPU path
    torch.manual_seed(0)
    x_cpu, y_cpu, k_cpu = next(iter(shard_loader(shards, 8, **{**kw, "output": "float32"})))
    torch.manual_seed(0)
    x_gpu, y_gpu, k_gpu = next(iter(shard_loader(shards, 8, decode="gpu", device="cpu",
                                                 **{**kw, "output": "float32"})))
    assert k_cpu == k_gpu and torch.equal(y_cpu, y_gpu)
    assert x_gpu.dtype == torch.float32 and torch.equal(x_cpu, x_gpu)


def test_a_png_sample_is_named_and_goes_through_the_error_policy(tmp_path, gpu_double):
    png = io.BytesIO()
    Image.new("RGB", (20, 20), (10, 200, 30)).save(png, format="PNG")
    samples = [{"__key__": f"{i:04d}", "jpg": _jpeg(20, 20, seed=i), "cls": 0} for i in range(7)]
    samples.insert(3, {"__key__": "0100", "png": png.getvalue(), "cls": 1})
    write_shards(samples, tmp_path / "s", maxcount=100, shuffle=False, progress=False)
    kw = dict(train=False, decode="gpu", device="cpu", num_workers=0, rank=0, world_size=1)
    with pytest.raises(ShardError, match=r"shard .*shard-000000\.tar: sample '0100': ValueError: "
                                         r"decode='gpu' reads JPEG images only .*\.png"):
        list(shard_loader(tmp_path / "s", 4, **kw))
    loader = shard_loader(tmp_path / "s", 4, handler="warn", **kw)
    assert sum(len(y) for _, y in loader) == 7
    assert loader.stats.skipped_samples == 1


def test_encoded_batch_packs_bytes_back_to_back():
    blobs = [bytes(random.Random(i).randbytes(n)) for i, n in enumerate((5, 0, 17))]
    samples = [((memoryview(b), (i, 0, 1, 1, False)), i, f"k{i}") for i, b in enumerate(blobs)]
    batch = gpu_decode.encoded_batch(samples, True,
                                     lambda shape, dtype: torch.empty(shape, dtype=dtype))
    assert batch.offsets == [0, 5, 5, 22] and len(batch) == 3
    assert [c.numpy().tobytes() for c in batch.chunks()] == blobs
    assert batch.labels.tolist() == [0, 1, 2] and batch.keys == ["k0", "k1", "k2"]
    assert batch.params[2] == (2, 0, 1, 1, False) and batch.pin_memory() is batch
