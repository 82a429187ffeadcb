"""TrainConfig: validation names the field, JSON round trips, every field has help text."""
from __future__ import annotations

import dataclasses
import time

import pytest

import gpu_lab
from gpu_lab import TrainConfig

import launch_fns

BAD_CONFIGS = [
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": -4}, ValueError, "batch_size"),
    ({"batch_size": 3.5}, TypeError, "batch_size"),
    ({"batch_size": "32"}, TypeError, "batch_size"),
    ({"lr": 0}, ValueError, "lr"),
    ({"lr": -1e-3}, ValueError, "lr"),
    ({"lr": float("nan")}, ValueError, "lr"),
    ({"lr": "fast"}, TypeError, "lr"),
    ({"optimizer": "adam"}, ValueError, "optimizer"),
    ({"scheduler": "linear"}, ValueError, "scheduler"),
    ({"mixed_precision": "fp8"}, ValueError, "mixed_precision"),
    ({"warmup_ratio": 1.5}, ValueError, "warmup_ratio"),
    ({"warmup_ratio": -0.1}, ValueError, "warmup_ratio"),
    ({"grad_accum_steps": 0}, ValueError, "grad_accum_steps"),
    ({"num_processes": 0}, ValueError, "num_processes"),
    ({"keep_last": 0}, ValueError, "keep_last"),
    ({"checkpoint_every": -1}, ValueError, "checkpoint_every"),
    ({"seed": -1}, ValueError, "seed"),
    ({"model": "resnet1000"}, ValueError, "model"),
    ({"augment": "heavy"}, ValueError, "augment"),
    ({"memory_threshold": 1.5}, ValueError, "memory_threshold"),
    ({"resume": "yes"}, TypeError, "resume"),
    ({"epochs": None, "max_steps": None}, ValueError, "max_steps"),
    ({"max_steps": 0}, ValueError, "max_steps"),
    ({"image_size": 4}, ValueError, "image_size"),
    ({"num_classes": 1}, ValueError, "num_classes"),
    ({"output_dir": ""}, ValueError, "output_dir"),  # "" is the current directory to os
    ({"output_dir": "  "}, ValueError, "output_dir"),
    ({"data_dir": " "}, ValueError, "data_dir"),
    ({"gpus": 0}, ValueError, "gpus"),
    ({"gpus": "two"}, ValueError, "gpus"),
    ({"gpus": [0, 0]}, ValueError, "gpus"),
    ({"gpus": [-1]}, ValueError, "gpus"),
    ({"gpus": []}, ValueError, "gpus"),
    ({"gpus": True}, TypeError, "gpus"),
    ({"gpus": 1.5}, TypeError, "gpus"),
    ({"gpus": 2, "num_processes": 4}, ValueError, "gpus"),
    ({"gpus": [0, 1, 2], "num_processes": 2}, ValueError, "gpus"),
    ({"priority": "high"}, TypeError, "priority"),
    ({"priority": 1.5}, TypeError, "priority"),
    ({"priority": 10**7}, ValueError, "priority"),
]


@pytest.mark.parametrize("kw,exc,field", BAD_CONFIGS, ids=[str(k) for k, _, _ in BAD_CONFIGS])
def test_bad_config_names_the_field(kw, exc, field):
    with pytest.raises(exc) as ei:
        TrainConfig(**kw)
    msg = str(ei.value)
    assert f"TrainConfig.{field}" in msg
    assert "got" in msg and ("accepted" in msg or "expected" in msg or "set max_steps" in msg)


def test_enum_error_lists_the_choices():
    with pytest.raises(ValueError, match="accepted: 'adamw', 'sgd'"):
        TrainConfig(optimizer="adam")


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match="Did you mean 'batch_size'"):
        TrainConfig.from_dict({"batch_sise": 8})


def test_json_round_trip():
    c = TrainConfig(model="tiny_resnet", max_steps=7, lr=3e-4, mixed_precision="bf16",
                    max_grad_norm=None, data_dir="/data/shards")
    assert TrainConfig.from_json(c.to_json()) == c


def test_seed_000_config_dict_is_accepted():
    seed = {"batch_size": 16, "num_epochs": 20, "lr": 3e-5, "optimizer": "AdamW",
            "scheduler": "cosine", "gradient_accumulation_steps": 4}
    c = TrainConfig.from_dict(seed)
    assert (c.batch_size, c.epochs, c.lr, c.optimizer, c.grad_accum_steps) == (16, 20, 3e-5,
                                                                                 "adamw", 4)


def test_other_tools_names_land_on_their_fields():
    # what torchrun, accelerate's config and a Trainer's arguments call them
    c = TrainConfig.from_dict({"nproc_per_node": 2, "learning_rate": 0.01, "precision": "BF16",
                               "save_total_limit": 3, "gpu_ids": "0,1", "max_steps": 5})
    assert (c.num_processes, c.lr, c.mixed_precision, c.keep_last, c.max_steps) == (
        2, 0.01, "bf16", 3, 5)
    assert c.gpus == [0, 1]


def test_every_field_has_help_for_the_form():
    helps = TrainConfig.field_help()
    assert set(helps) == {f.name for f in dataclasses.fields(TrainConfig)}
    for name, h in helps.items():
        assert len(h["help"]) > 10, name
        assert h["type"] in (bool, int, float, str), name
    assert helps["optimizer"]["choices"] == ("adamw", "sgd")


BAD_LAUNCHES = [
    (dict(fn=42), TypeError, "fn"),
    (dict(num_processes=0), ValueError, "num_processes"),
    (dict(num_processes=1.5), TypeError, "num_processes"),
    (dict(num_processes=True), TypeError, "num_processes"),
    (dict(mixed_precision="fp32"), ValueError, "mixed_precision"),
    (dict(mixed_precision="fp16"), ValueError, "fp16"),  # no GPU here
    (dict(config="cfg.json"), TypeError, "config"),
    (dict(config={"lr": -1}), ValueError, "lr"),
    (dict(name=""), ValueError, "name"),
    (dict(num_nodes=0), ValueError, "num_nodes"),
    (dict(num_nodes=2, node_rank=2, port=29400), ValueError, "node_rank"),
    (dict(num_nodes=2), ValueError, "port"),
    (dict(port=70000), ValueError, "port"),
    (dict(rdzv_backend="etcd"), ValueError, "rdzv_backend"),
]


@pytest.mark.parametrize("kw,exc,needle", BAD_LAUNCHES, ids=[str(k) for k, _, _ in BAD_LAUNCHES])
def test_bad_launch_arguments_fail_before_anything_starts(kw, exc, needle, gpu_lab_home):
    kw = dict(kw)
    fn = kw.pop("fn", launch_fns.train_linear)
    with pytest.raises(exc, match=needle):
        gpu_lab.launch(fn, **kw)
    assert not (gpu_lab_home / "runs").exists() or not any((gpu_lab_home / "runs").iterdir())


def test_blank_paths_are_refused_but_an_empty_data_dir_means_synthetic_data():
    with pytest.raises(ValueError, match=r"TrainConfig.output_dir: got ''; expected a folder path"):
        TrainConfig(output_dir="")
    with pytest.raises(ValueError, match=r"TrainConfig.data_dir: got ' '.*empty \(None\) for "
                                         r"synthetic data"):
        TrainConfig(data_dir=" ")
    assert TrainConfig(data_dir="").data_dir is None  # the form's empty field


@pytest.mark.parametrize("given,kept", [
    (None, None), ("", None), (2, 2), ("2", 2), (" 3 ", 3), ([0, 1], [0, 1]), ((4,), [4]),
    ("0,1", [0, 1]), ("[0, 1]", [0, 1]), ("[2]", [2]), ("all", "all"), ("ALL", "all")])
def test_gpus_takes_what_launch_takes_and_the_forms_text(given, kept):
    c = TrainConfig(gpus=given)
    assert c.gpus == kept
    assert TrainConfig.from_json(c.to_json()) == c
    assert TrainConfig.from_dict({"gpu_ids": "0,1"}).gpus == [0, 1]  # accelerate's name


@pytest.mark.slow  # over half a second
def test_launch_takes_gpus_and_priority_from_the_config(gpu_lab_home, tmp_path, monkeypatch):
    import queue_fns
    from gpu_lab.supervise.claims import host_queue

    # the config's gpus reach launch's own check: this host has no GPU 999 (nor any GPU here)
    with pytest.raises(ValueError, match=r"gpus=\[999\]"):
        gpu_lab.launch(launch_fns.train_linear, config=TrainConfig(gpus=[999], max_steps=1))
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(tmp_path / "claims"))
    go = tmp_path / "go"
    run = gpu_lab.launch(queue_fns.hold_until, str(go), num_processes=1,
                         config=TrainConfig(priority=3, max_steps=1))
    try:
        deadline = time.monotonic() + 60
        while not host_queue() and time.monotonic() < deadline:
            run.wait(0.05)
        (row,) = host_queue()
        assert (row.run_id, row.priority, row.state) == (run.id, 3, "holding")
    finally:
        go.write_text("")
    assert run.wait(60) == "succeeded"
