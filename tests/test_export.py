"""gpu_lab.export: the exported torchrun command really runs (2 gloo ranks, metrics in the registry),
and every exported file is read by the tool that consumes it (YAML, bash, accelerate's and
torchrun's own parsers, sbatch where Slurm is installed)."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpu_lab.config import TrainConfig
from gpu_lab.export import EntryError, JobSpec, export
from gpu_lab.record.registry import Registry

from gpu_lab.cluster import sandbox
from job_utils import TESTS, job_env

@pytest.mark.slow  # over half a second
@pytest.mark.timeout(600)
def test_exported_torchrun_command_runs_two_gloo_ranks_into_the_registry(tmp_path):
    cfg = TrainConfig(max_steps=5, lr=0.05, num_processes=2, tensorboard=False)
    job = export(cfg, "export_fns:train_tiny", "torchrun", out_dir=tmp_path / "job")
    assert job.argv[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    assert (tmp_path / "job" / "config.json").is_file()
    home = tmp_path / "home"
    out = subprocess.run(job.argv, cwd=tmp_path / "job", env=job_env(home), capture_output=True,
                         text=True, timeout=500, start_new_session=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    reg = Registry(home / "registry.db")
    [row] = reg.list_runs()
    assert row["status"] == "succeeded", row
    assert (row["kind"], row["num_processes"], row["num_nodes"], row["node_rank"]) == \
        ("torchrun", 2, 1, 0)
    assert row["config"]["max_steps"] == 5 and row["name"] == "train_tiny"
    for rank in (0, 1):
        steps = [m["step"] for m in reg.metrics(row["id"], "loss", rank)]
        assert steps == [0, 1, 2, 3, 4], (rank, steps)
    assert {m["value"] for m in reg.metrics(row["id"], "lr")} == {0.05}
    with open(Path(row["run_dir"]) / "result.pkl", "rb") as f:
        result = pickle.load(f)
    assert (result["world_size"], result["distributed_type"]) == (2, "MULTI_CPU")
    p0, p1 = result["params"]
    assert p0 == pytest.approx(p1, abs=1e-7), "the two ranks did not train one DDP model"


def test_pytorchjob_yaml_has_master_and_workers_with_gpu_limits(tmp_path):
    cfg = TrainConfig(model="resnet50", mixed_precision="bf16", max_steps=1000)
    job = export(cfg, "export_fns:train_tiny", "kubernetes", num_nodes=3, nproc_per_node=8,
                 image="registry.example.com/team/train:1.2", shm_size="32Gi", name="resnet-50",
                 env={"NCCL_DEBUG": "WARN"}, out_dir=tmp_path)
    doc = yaml.safe_load((tmp_path / "pytorchjob.yaml").read_text())
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["metadata"]["name"] == "resnet-50"
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        [c] = pod["containers"]
        assert c["name"] == "pytorch"
        assert c["image"] == "registry.example.com/team/train:1.2"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        cmd = c["command"]
        assert cmd[0] == "torchrun" and "--nnodes=3" in cmd and "--nproc-per-node=8" in cmd
        assert "--node-rank=$(RANK)" in cmd and "--master-addr=$(MASTER_ADDR)" in cmd
        assert cmd[cmd.index("-m") + 1:] == ["gpu_lab.rank.headless", "export_fns:train_tiny",
                                             "--config", "/etc/gpu_lab/config.json"]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert vols["config"]["configMap"]["name"] == "resnet-50-config"
    cm = yaml.safe_load((tmp_path / "configmap.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "resnet-50-config"
    assert TrainConfig.from_json(cm["data"]["config.json"]) == cfg
    assert "nvidia.com/gpu" in job.explanation and "/dev/shm" in job.explanation


def test_single_node_pytorchjob_has_only_a_master():
    job = export(TrainConfig(), "export_fns:train_tiny", "kubernetes", nproc_per_node=2)
    doc = yaml.safe_load(job.files["pytorchjob.yaml"])
    assert set(doc["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert "--standalone" in doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["command"]


def test_sbatch_script_passes_bash_n_with_signal_requeue_and_resources(tmp_path):
    from gpu_lab.rank.outcome import STOP_EXIT_CODE as PREEMPT_EXIT_CODE
    from gpu_lab.train.guards import PREEMPT_EXIT_CODE as GUARD_EXIT_CODE

    job = export(TrainConfig(max_steps=10), "export_fns:train_tiny", "slurm", num_nodes=2,
                 nproc_per_node=4, partition="gpu", account="proj42", time_limit="2-00:00:00",
                 env={"NCCL_IB_DISABLE": "1"}, out_dir=tmp_path)
    script = tmp_path / "train.sbatch"
    assert os.access(script, os.X_OK)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = script.read_text()
    directives = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    for d in ("--nodes=2", "--ntasks-per-node=4", "--gres=gpu:4", "--signal=SIGUSR1@90",
              "--requeue", "--time=2-00:00:00", "--partition=gpu", "--account=proj42"):
        assert d in directives, (d, directives)
    assert all(" " not in d for d in directives), "sbatch would read trailing words as options"
    assert PREEMPT_EXIT_CODE == GUARD_EXIT_CODE == 143
    assert 'if [ "$rc" -eq 143 ]; then' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "srun python -m gpu_lab.rank.headless export_fns:train_tiny --config config.json" in text
    assert "export NCCL_IB_DISABLE=1" in text
    assert job.command == "sbatch train.sbatch"


@pytest.mark.skipif(not sandbox.installed(),
                    reason="Slurm is not installed (`make test` installs Debian's slurmctld, slurmd, "
                           "slurm-client and munge)")
@pytest.mark.slow  # over half a second
def test_sbatch_test_only_accepts_the_script(tmp_path):
    """A private one-node cluster (slurmctld + slurmd + munged in a temp dir) schedules the
    generated script: `sbatch --test-only` parses every #SBATCH line and says when it would start."""
    export(TrainConfig(max_steps=10), "export_fns:train_tiny", "slurm", device="cpu",
           nproc_per_node=1, cpus_per_task=1, time_limit="00:05:00", out_dir=tmp_path)
    with sandbox.private_cluster(tmp_path / "slurm") as env:
        out = subprocess.run(["sbatch", "--test-only", "train.sbatch"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "to start at" in out.stdout + out.stderr and "using 1 processors" in out.stderr, out.stderr


def test_accelerate_config_and_command_are_read_by_accelerate(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    cfg = TrainConfig(mixed_precision="bf16")
    job = export(cfg, "export_fns:train_tiny", "accelerate", num_nodes=2, nproc_per_node=4,
                 port=29555, out_dir=tmp_path)
    loaded = load_config_from_file(str(tmp_path / "accelerate_config.yaml"))
    assert (loaded.num_machines, loaded.num_processes) == (2, 8)  # accelerate counts all machines
    assert str(loaded.distributed_type) in ("MULTI_GPU", "DistributedType.MULTI_GPU")
    assert str(loaded.mixed_precision) in ("bf16", "PrecisionType.BF16")
    assert loaded.main_process_port == 29555
    argv = [a.replace("${NODE_RANK}", "1").replace("$MASTER_ADDR", "10.0.0.7") for a in job.argv]
    assert argv[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(argv[2:])
    assert args.module and args.training_script == "gpu_lab.rank.headless"
    assert args.training_script_args == ["export_fns:train_tiny", "--config", "config.json"]
    assert (args.machine_rank, args.main_process_ip) == (1, "10.0.0.7")


@pytest.mark.parametrize("device, nodes", [("cuda", 1), ("cuda", 2), ("cpu", 1)])
def test_an_exported_accelerate_config_is_read_back_as_launch_reads_it(tmp_path, monkeypatch,
                                                                       recwarn, device, nodes):
    """`gpu-lab export accelerate` writes a file that launch(config_file=...) takes back: the
    same precision, ranks and machines, nothing it would not pass on."""
    from gpu_lab.launch import accelerate_config

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = TrainConfig(mixed_precision="bf16")
    export(cfg, "export_fns:train_tiny", "accelerate", num_nodes=nodes, nproc_per_node=2,
           port=29555, device=device, master_addr="10.0.0.7", out_dir=tmp_path)
    back = accelerate_config.read(tmp_path / "accelerate_config.yaml", explicit={}, device=device,
                                  gpu_indices=[0, 1])
    assert back.mixed_precision == "bf16" and back.env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert back.num_processes == 2 and (back.num_nodes or 1) == nodes
    if nodes > 1:
        assert (back.master_addr, back.port) == ("10.0.0.7", 29555)
    assert back.not_passed == [] and not [w for w in recwarn if "pass on" in str(w.message)]


def test_multinode_torchrun_command_is_read_by_torchrun():
    from torch.distributed.run import parse_args

    job = export(TrainConfig(), "export_fns:train_tiny", "torchrun", num_nodes=4,
                 nproc_per_node=8, port=29401, name="big-job")
    # double-quoted, not single: the shell on each node expands it, as one word
    assert '--rdzv-endpoint="$MASTER_ADDR":29401' in job.command
    args = parse_args([a.replace("$MASTER_ADDR", "10.0.0.7") for a in job.argv[1:]])
    assert (args.nnodes, args.nproc_per_node) == ("4", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "10.0.0.7:29401",
                                                                      "big-job")
    assert args.module and args.training_script == "gpu_lab.rank.headless"
    assert args.training_script_args == ["export_fns:train_tiny", "--config", "config.json"]
    static = export(TrainConfig(), "export_fns:train_tiny", "torchrun", num_nodes=2,
                    rdzv_backend="static", master_addr="node0.cluster")
    args = parse_args([a.replace("${NODE_RANK}", "1") for a in static.argv[1:]])
    assert (args.node_rank, args.master_addr, args.master_port) == (1, "node0.cluster", 29400)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_nodes=0), ValueError, ["num_nodes", "0", ">= 1"]),
    (dict(nproc_per_node=0), ValueError, ["nproc_per_node"]),
    (dict(num_nodes=1.5), TypeError, ["num_nodes", "1.5"]),
    (dict(port=70000), ValueError, ["port", "65535"]),
    (dict(device="tpu"), ValueError, ["device", "'cuda'", "'cpu'"]),
    (dict(rdzv_backend="etcd"), ValueError, ["rdzv_backend", "'c10d'"]),
    (dict(time_limit="soon"), ValueError, ["time_limit", "HH"]),
    (dict(shm_size="lots"), ValueError, ["shm_size", "16Gi"]),
    (dict(env={"BAD NAME": "1"}), ValueError, ["env", "BAD NAME"]),
    (dict(target="helm"), ValueError, ["target", "'helm'", "'slurm'", "'kubernetes'"]),
    (dict(entry="export_fns.train_tiny"), EntryError, ["module:function"]),
    (dict(entry="no_such_module_xyz:train"), EntryError, ["no_such_module_xyz",
                                                         "cannot be imported", "PYTHONPATH"]),
    (dict(entry="export_fns:no_such_fn"), EntryError, ["no attribute", "train_tiny"]),
    (dict(entry="export_fns:not_callable"), EntryError, ["not a function"]),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, kwargs, error, words):
    kw = dict(entry="export_fns:train_tiny", target="all")
    kw.update(kwargs)
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        export(TrainConfig(), kw.pop("entry"), kw.pop("target"), out_dir=out, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert not out.exists()


def test_fp16_on_cpu_and_unknown_config_fields_are_refused():
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        JobSpec("export_fns:train_tiny", TrainConfig(mixed_precision="fp16"), device="cpu")
    with pytest.raises(ValueError, match="num_epoch"):
        export({"num_epoch": 3}, "export_fns:train_tiny")
    # a module that exists only on the cluster: syntax checked, import skipped on request
    spec = JobSpec("cluster_only.module:train", check_import=False)
    assert spec.entry == "cluster_only.module:train"


def test_entry_may_be_a_function_object():
    import export_fns

    job = export(TrainConfig(), export_fns.train_tiny, "torchrun")
    assert "export_fns:train_tiny" in job.command
    with pytest.raises(EntryError, match="module-level"):
        export(TrainConfig(), lambda cfg: None, "torchrun")


def test_cli_export_writes_every_target(tmp_path, capsys, monkeypatch):
    from gpu_lab.cli import main

    cfg = tmp_path / "cfg.json"
    cfg.write_text(TrainConfig(max_steps=7, mixed_precision="bf16").to_json())
    monkeypatch.chdir(tmp_path)
    rc = main(["export", "all", "--entry", "export_fns:train_tiny", "--config", str(cfg),
               "--out", "job", "--nodes", "2", "--gpus-per-node", "4", "--env", "A=1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "# slurm: sbatch train.sbatch" in printed
    files = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert files == ["accelerate_config.yaml", "config.json", "configmap.yaml", "pytorchjob.yaml",
                     "train.sbatch", "trainjob.yaml"]
    assert json.loads((tmp_path / "job" / "config.json").read_text())["max_steps"] == 7
    rc = main(["export", "torchrun", "--entry", "nope_not_here:train"])
    err = capsys.readouterr().err
    assert rc == 2 and "nope_not_here" in err and "cannot be imported" in err


def test_exporting_imports_no_torch_and_no_widgets():
    code = ("import sys; from gpu_lab.export import export; "
            "jobs = export({'max_steps': 3}, 'export_fns:train_tiny', num_nodes=2); "
            "heavy = [m for m in ('torch', 'ipywidgets', 'plotly', 'IPython') if m in sys.modules]; "
            "print(len(jobs), heavy)")
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.stdout.strip() == "5 []", out.stdout + out.stderr
