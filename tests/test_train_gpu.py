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

from gpu_lab.telemetry_probe import gpu_count

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU (NVML sees none)")


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
