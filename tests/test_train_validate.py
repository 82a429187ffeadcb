"""Impossible configurations fail in the kernel, before any process starts, with clear errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_lab.config import TrainConfig
from gpu_lab.train.validate import ConfigError, validate


@pytest.mark.parametrize("bad, field, words", [
    ({"grad_accum_steps": 0}, "grad_accum_steps", ">= 1"),
    ({"model": "resnet1000"}, "model", "tiny_cnn"),
    ({"warmup_ratio": 1.5}, "warmup_ratio", "<= 1"),
    ({"mixed_precision": "fp8"}, "mixed_precision", "'bf16'"),
    ({"optimizer": "lamb"}, "optimizer", "'adamw'"),
    ({"gradient_accumulation_steps": -2}, "grad_accum_steps", ">= 1"),  # seed 000's key name
    ({"batch_sise": 32}, "batch_sise", "batch_size"),  # a typo gets the closest field
])
def test_field_errors_name_field_value_and_range(bad, field, words):
    with pytest.raises((ValueError, TypeError)) as e:
        validate(bad, gpu_count=0)
    msg = str(e.value)
    assert field in msg and words in msg, msg


@pytest.mark.parametrize("cfg, gpus, field, words", [
    ({"mixed_precision": "fp16"}, 0, "mixed_precision", "no GPU"),
    ({"model": "vit_b_16", "image_size": 100}, 0, "image_size", "multiple of 16"),
    ({"model": "tiny_vit", "image_size": 20}, 0, "image_size", "multiple of 8"),
    ({"model": "vgg16", "image_size": 16}, 0, "image_size", ">= 32"),
    ({"num_processes": 4}, 2, "num_processes", "1..2"),
    ({"data_dir": "/nonexistent/gpu_lab/data"}, 0, "data_dir", "no such directory"),
    ({"max_steps": 5, "profile_steps": 10}, 0, "profile_steps", "0..5"),
    ({"zero": True, "num_processes": 1}, 0, "zero", "num_processes >= 2"),
    ({"powersgd": True, "num_processes": 1}, 0, "powersgd", "num_processes >= 2"),
    ({"oom_retry": True, "num_processes": 2}, 0, "oom_retry", "one process"),
])
def test_impossible_combinations(cfg, gpus, field, words):
    with pytest.raises(ConfigError) as e:
        validate(cfg, gpu_count=gpus)
    assert e.value.field == field
    assert words in str(e.value) and f"TrainConfig.{field}" in str(e.value), str(e.value)


def test_valid_configs_pass_and_come_back_as_trainconfig():
    cfg = validate({"model": "tiny_vit", "image_size": 32, "precision": "bf16",
                    "num_epochs": 2}, gpu_count=0)
    assert isinstance(cfg, TrainConfig) and cfg.mixed_precision == "bf16" and cfg.epochs == 2
    assert validate(TrainConfig(mixed_precision="fp16"), gpu_count=1).mixed_precision == "fp16"


def test_fp16_on_this_host_is_refused_through_nvml():
    """Without gpu_count=…, validate asks NVML (never torch.cuda) how many GPUs there are."""
    from gpu_lab.telemetry.probe import gpu_count

    if gpu_count() == 0:
        with pytest.raises(ConfigError, match="no GPU"):
            validate({"mixed_precision": "fp16"})
    else:  # a GPU host: fp16 is fine
        assert validate({"mixed_precision": "fp16"}).mixed_precision == "fp16"


def test_validation_imports_neither_torch_nor_cuda():
    code = ("import sys, gpu_lab.train as t\n"
            "try:\n    t.validate({'mixed_precision': 'fp16', 'model': 'tiny_cnn'}, gpu_count=0)\n"
            "except t.ConfigError as e:\n    print('refused:', e.field)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused:", "mixed_precision", "False"]


def test_fit_refuses_before_building_anything(tmp_path, monkeypatch):
    import torch

    import gpu_lab.telemetry.probe
    from gpu_lab.train import fit

    monkeypatch.setattr(gpu_lab.telemetry.probe, "gpu_count", lambda: 0)  # a CPU-only host
    out = tmp_path / "never"
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="mixed_precision"):
        fit(torch.nn.Linear(1, 1), data, {"mixed_precision": "fp16", "output_dir": str(out)})
    assert not out.exists()


def test_bf16_on_a_pre_ampere_gpu_is_refused(monkeypatch):
    """NVML reports compute capability 7.5 (a T4): bf16 has no hardware support there."""
    import gpu_lab.train.validate as v

    monkeypatch.setattr(v, "min_compute_capability", lambda: (7, 5))  # an NVML answer double
    with pytest.raises(ConfigError, match="compute capability 7.5"):
        validate({"mixed_precision": "bf16"}, gpu_count=1)
    monkeypatch.setattr(v, "min_compute_capability", lambda: (9, 0))
    assert validate({"mixed_precision": "bf16"}, gpu_count=1).mixed_precision == "bf16"
    assert validate({"mixed_precision": "bf16"}, gpu_count=0).mixed_precision == "bf16"  # CPU bf16


@pytest.mark.parametrize("cfg, gpus, field, words", [
    ({"sharding": "fsdp", "mixed_precision": "fp16"}, 1, "mixed_precision", "Use 'bf16'"),
    ({"sharding": "fsdp", "powersgd": True}, 0, "powersgd", "Use one of the two"),
    ({"sharding": "fsdp", "compile": True}, 0, "compile", "Use one of the two"),
    ({"sharding": "fsdp", "offload": True}, 0, "offload", "live in CPU memory already"),
])
def test_what_fit_cannot_shard_with_fsdp_is_refused(cfg, gpus, field, words):
    with pytest.raises(ConfigError) as e:
        validate(cfg, gpu_count=gpus)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_zero_and_sharding_say_the_same_and_offload_needs_fsdp():
    assert TrainConfig(zero=True).sharding == "zero1"
    assert TrainConfig(sharding="zero1").zero is True
    assert TrainConfig(sharding="fsdp").zero is False
    assert TrainConfig.from_dict({"sharding": "FSDP"}).sharding == "fsdp"
    with pytest.raises(ValueError, match="zero: got True with sharding='fsdp'"):
        TrainConfig(zero=True, sharding="fsdp")
    with pytest.raises(ValueError, match="offload: got True with sharding='none'"):
        TrainConfig(offload=True)
    with pytest.raises(ValueError, match="accepted: .*'zero1'"):
        TrainConfig(sharding="zero3")
