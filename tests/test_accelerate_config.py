"""The user's `accelerate config` reaches the ranks as `accelerate launch` would give it: the
environment gpu_lab builds for a rank, without starting one, against the one accelerate's own
launcher builds for the same file (its launch command run for real, only the process start
caught); the refusals of what a host cannot do; precedence."""
from __future__ import annotations

import os
import re
import sys
import types

import pytest
import yaml

from gpu_lab.launch import accelerate_config as ac

# what gpu_lab sets in every rank by design, not from the file (accelerate_config.BY_DESIGN)
BY_DESIGN = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU",
             "PYTHONPATH"}

BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
        "mixed_precision": "no", "num_processes": 2, "num_machines": 1, "machine_rank": 0,
        "gpu_ids": "all", "use_cpu": False, "debug": False, "main_training_function": "main",
        "rdzv_backend": "static", "same_network": True}
FILES = {
    "bf16": {"mixed_precision": "bf16"},
    "fp16 + dynamo": {"mixed_precision": "fp16",
                      "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune",
                                        "dynamo_use_fullgraph": True}},
    "FSDP, wrap policy, offload": {
        "distributed_type": "FSDP", "mixed_precision": "bf16",
        "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                        "fsdp_min_num_params": 100000, "fsdp_offload_params": True,
                        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                        "fsdp_reshard_after_forward": True, "fsdp_cpu_ram_efficient_loading": True,
                        "fsdp_activation_checkpointing": False}},
    "gpu_ids": {"gpu_ids": "1,2", "mixed_precision": "bf16"},
    "DeepSpeed stage 2": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                          "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu",
                                               "gradient_accumulation_steps": 4,
                                               "gradient_clipping": 1.0}},
}


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


def _file(tmp_path, settings: dict, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, **settings}))
    return path


def _what_accelerate_launch_gives(path, monkeypatch, *flags: str) -> dict[str, str]:
    """`accelerate launch --config_file path [flags] train.py`, run through accelerate's own
    launch command; only the start of the processes is caught, with the environment it had."""
    from accelerate.commands import launch as cmd

    got: dict[str, str] = {}

    def caught_torchrun(args):
        got.update(os.environ)  # multi_gpu_launcher and DeepSpeed's patch the environment first

    def caught_subprocess(command, env, quiet):
        got.update(env)

    monkeypatch.setattr(cmd, "_run_torchrun", caught_torchrun)
    monkeypatch.setattr(cmd, "_run_subprocess", caught_subprocess)
    monkeypatch.setattr(cmd, "is_deepspeed_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deepspeed.launcher.runner",
                        types.SimpleNamespace(DEEPSPEED_ENVIRONMENT_NAME=".deepspeed_env"))
    before = dict(os.environ)
    args = cmd.launch_command_parser().parse_args(["--config_file", str(path), *flags, "train.py"])
    cmd.launch_command(args)
    assert os.environ == before  # accelerate restored it
    return {k: v for k, v in got.items() if before.get(k) != v}


@pytest.mark.parametrize("case", list(FILES))
def test_a_rank_gets_what_accelerate_launch_gives_on_a_gpu_host(case, tmp_path, monkeypatch,
                                                                  hf_home):
    path = _file(tmp_path, FILES[case])
    monkeypatch.setattr(ac, "has_deepspeed", lambda: True)  # accelerate builds it without it
    ours = ac.read(path, explicit={}, device="cuda", gpu_indices=[0, 1, 2, 3])
    theirs = _what_accelerate_launch_gives(path, monkeypatch)
    assert ours.env == {k: v for k, v in theirs.items() if k not in BY_DESIGN}
    assert set(theirs) - set(ours.env) <= BY_DESIGN  # all that differs is named
    assert ours.mixed_precision == FILES[case]["mixed_precision"]
    assert ours.set["mixed_precision"] == FILES[case]["mixed_precision"]
    if case == "gpu_ids":
        assert ours.gpus == [1, 2] and theirs["CUDA_VISIBLE_DEVICES"] == "1,2"
    if case.startswith("FSDP"):
        assert ours.sharding == "fsdp2" and ours.env["FSDP_OFFLOAD_PARAMS"] == "true"
        assert ours.env["FSDP_AUTO_WRAP_POLICY"] == "SIZE_BASED_WRAP"
    if case.startswith("DeepSpeed"):
        assert ours.sharding == "deepspeed stage 2"


def test_a_cpu_rank_gets_what_accelerate_launch_cpu_gives(tmp_path, monkeypatch, hf_home):
    path = _file(tmp_path, FILES["bf16"])
    ours = ac.read(path, explicit={}, device="cpu", gpu_indices=[])
    theirs = _what_accelerate_launch_gives(path, monkeypatch, "--cpu")
    assert ours.env == {k: v for k, v in theirs.items() if k not in BY_DESIGN}
    assert ours.env["ACCELERATE_MIXED_PRECISION"] == "bf16" and ours.num_processes == 2


def test_flags_win_over_the_file_as_in_accelerate_launch(tmp_path, monkeypatch, hf_home):
    path = _file(tmp_path, FILES["bf16"])
    ours = ac.read(path, explicit={"mixed_precision": "no", "num_processes": 4}, device="cuda",
                   gpu_indices=[0, 1, 2, 3])
    theirs = _what_accelerate_launch_gives(path, monkeypatch, "--mixed_precision", "no",
                                           "--num_processes", "4")
    assert ours.env["ACCELERATE_MIXED_PRECISION"] == theirs["ACCELERATE_MIXED_PRECISION"] == "no"
    assert ours.mixed_precision == "no"


def test_the_default_file_is_accelerates_and_none_means_none(tmp_path, monkeypatch, hf_home):
    assert ac.default_file() == hf_home / "accelerate" / "default_config.yaml"
    assert ac.resolve(None) is None  # no file: nothing to read
    ac.default_file().parent.mkdir(parents=True)
    ac.default_file().write_text(yaml.safe_dump({**BASE, "mixed_precision": "bf16"}))
    assert ac.resolve(None) == ac.default_file()
    assert ac.resolve(False) is None
    assert ac.read(None, explicit={}, device="cpu", gpu_indices=[]).mixed_precision == "bf16"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ac.resolve(tmp_path / "nowhere.yaml")
    with pytest.raises(ValueError, match="accepted: the path of an accelerate config file"):
        ac.resolve(3)


@pytest.mark.parametrize("settings, device, gpus, words", [
    ({"mixed_precision": "fp16"}, "cpu", [], "mixed_precision: fp16 needs a GPU"),
    ({"mixed_precision": "fp8"}, "cpu", [], "mixed_precision: fp8 needs a GPU"),
    (FILES["FSDP, wrap policy, offload"], "cpu", [], "distributed_type: FSDP needs GPUs"),
    (FILES["DeepSpeed stage 2"], "cpu", [], "distributed_type: DEEPSPEED needs GPUs"),
    (FILES["DeepSpeed stage 2"], "cuda", [0, 1], "the deepspeed package is not installed"),
    ({"gpu_ids": "0,3"}, "cuda", [0, 1], "names GPU(s) 3, but this host's GPUs are 0, 1"),
    ({"gpu_ids": "0,1"}, "cpu", [], "gpu_ids: 0,1 but this host has no GPU"),
    ({"num_machines": 2, "num_processes": 4}, "cuda", [0, 1], "without main_process_ip"),
    ({"nonsense_key": 1}, "cuda", [0, 1], "accelerate refuses it: The config file at"),
])
def test_what_the_host_cannot_honour_is_refused_with_the_setting_named(
        settings, device, gpus, words, tmp_path, hf_home):
    path = _file(tmp_path, settings)
    with pytest.raises(ac.AccelerateConfigError, match=re.escape(words)) as e:
        ac.read(path, explicit={}, device=device, gpu_indices=gpus)
    assert str(path) in str(e.value)


def test_a_setting_gpu_lab_does_not_pass_on_is_named(tmp_path, hf_home):
    path = _file(tmp_path, {"downcast_bf16": True, "tpu_name": "pod-1"})
    with pytest.warns(UserWarning, match="does not pass on downcast_bf16, tpu_name"):
        s = ac.read(path, explicit={}, device="cpu", gpu_indices=[])
    assert s.not_passed == ["downcast_bf16", "tpu_name"]


def test_a_multi_machine_file_maps_onto_launchs_nodes(tmp_path, hf_home):
    path = _file(tmp_path, {"num_machines": 2, "num_processes": 8, "machine_rank": 1,
                            "main_process_ip": "10.0.0.1", "main_process_port": 29555})
    s = ac.read(path, explicit={}, device="cuda", gpu_indices=[0, 1, 2, 3])
    assert (s.num_processes, s.num_nodes, s.node_rank, s.master_addr, s.port) == (
        4, 2, 1, "10.0.0.1", 29555)  # accelerate counts processes over all machines
