"""The GPU-only paths of fit(): fp16 autocast with GradScaler loss scaling (its state saved and
resumed), the real memory probe, and activation checkpointing measured by CUDA's allocator.

Skipped where NVML sees no GPU: fp16 loss scaling needs CUDA, and bf16 on CPU, the memory guard
with a probe double, and the CPU measurement of activation checkpointing are covered elsewhere.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_lab.telemetry.probe import gpu_count

pytestmark = [pytest.mark.slow,  # starts processes (ranks, kernels, servers) or runs for seconds
              pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU (NVML sees none)")]


def test_fp16_gradscaler_resume_and_gpu_memory(tmp_path):
    script = Path(__file__).with_name("train_gpu_script.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-5000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print("\nGPU check:", json.dumps(r, indent=1))
    assert r["first"]["mixed_precision"] == "fp16" and r["first"]["steps"] == 20
    assert r["head_dtypes"] == ["torch.float16"]
    assert r["scaler_state"]["scale"] > 0  # GradScaler's scale was saved with the checkpoint
    assert r["second"]["resumed_from"].endswith("step_000000020") and r["second"]["steps"] == 30
    assert r["second"]["loss"] == r["second"]["loss"]  # finite, not NaN
    assert 0.0 < r["memory_fraction"] < 1.0
    peaks = r["resnet18_peak_bytes"]
    assert peaks["checkpointed"] < peaks["plain"]


def test_pinned_shard_batches_come_through_the_ring_and_free_it_at_once(tmp_path):
    """With pin_memory (only possible with a GPU) the DataLoader's pin thread materializes ring slots
    (RingBatch.pin_memory) into pinned memory; held on the GPU, every batch equals the one decoded
    in-process."""
    import torch

    from gpu_lab.data import make_synthetic_images, shard_loader, write_shards

    make_synthetic_images(tmp_path / "img", 120, image_size=20, num_classes=4, seed=1)
    write_shards(tmp_path / "img", tmp_path / "s", maxcount=15, progress=False)
    kw = dict(train=False, image_size=16, rank=0, world_size=1, output="uint8", return_keys=True)
    ref = {}
    for x, _, keys in shard_loader(tmp_path / "s", 8, num_workers=0, pin_memory=False, **kw):
        ref.update(zip(keys, x.clone()))
    batches = list(shard_loader(tmp_path / "s", 4, num_workers=2, pin_memory=True, device="cuda", **kw))
    assert sum(len(k) for _, _, k in batches) == 120
    for x, _, keys in batches:
        assert x.is_cuda
        for img, key in zip(x.cpu(), keys):
            assert torch.equal(img, ref[key])
