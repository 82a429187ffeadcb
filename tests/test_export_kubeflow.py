"""Kubeflow exports against the real CRDs (shared/testdata/kubeflow, see its README): the Trainer v2
TrainJob and ClusterTrainingRuntime, and the training-operator v1 PyTorchJob, each validated
against its CRD's openAPIV3Schema with undeclared fields as errors (the API server would prune
them), for 1 node x 1 GPU, 4 nodes x 8 GPUs and CPU only; the strict check itself is shown to catch
injected mistakes; torchrun reads the TrainJob's command with the PET_* variables Trainer sets."""
from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml

import crd_schema
from gpu_lab.config import TrainConfig
from gpu_lab.export import JobSpec, export

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def _kubeflow_dir() -> Path:
    """shared/testdata/kubeflow beside the checkout (or, from a git worktree elsewhere, beside the
    repository's main checkout)."""
    candidates = [SHARED]
    common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                            cwd=ROOT, capture_output=True, text=True)
    if common.returncode == 0 and common.stdout.strip():
        candidates.append(Path(common.stdout.strip()).parent.parent / "shared")
    for c in candidates:
        if (c / "testdata" / "kubeflow").is_dir():
            return c / "testdata" / "kubeflow"
    pytest.skip(f"the Kubeflow CRDs are not here: {SHARED / 'testdata' / 'kubeflow'} (the "
                "../shared/testdata folder of the project checkout)")
ENTRY = "export_fns:train_tiny"
SHAPES = {
    "1x1-gpu": dict(num_nodes=1, nproc_per_node=1),
    "4x8-gpu": dict(num_nodes=4, nproc_per_node=8, env={"NCCL_DEBUG": "WARN"}, namespace="team-a"),
    "cpu-only": dict(num_nodes=2, nproc_per_node=2, device="cpu", cpus_per_task=4),
}


@pytest.fixture(scope="module")
def crds() -> dict[str, dict]:
    files = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
             "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
             "PyTorchJob": "kubeflow.org_pytorchjobs.yaml"}
    kubeflow = _kubeflow_dir()
    return {kind: crd_schema.load_crd(kubeflow / f) for kind, f in files.items()}


def _doc(text: str) -> dict:
    [doc] = list(yaml.safe_load_all(text))
    return doc


@pytest.mark.slow  # over half a second
@pytest.mark.parametrize("define_runtime", [False, True], ids=["stock-runtime", "own-runtime"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_trainjob_validates_against_the_trainer_v2_crds(crds, shape, define_runtime, tmp_path):
    kw = SHAPES[shape]
    cfg = TrainConfig(max_steps=100, mixed_precision="bf16")
    job = export(cfg, ENTRY, "trainjob", image="registry.example.com/t/train:2", shm_size="8Gi",
                 define_runtime=define_runtime, out_dir=tmp_path, **kw)
    tj = _doc((tmp_path / "trainjob.yaml").read_text())
    assert crd_schema.errors(tj, crds["TrainJob"]) == []
    spec = tj["spec"]
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (kw["num_nodes"],
                                                                kw["nproc_per_node"])
    limits = trainer["resourcesPerNode"]["limits"]
    if kw.get("device") == "cpu":
        assert "nvidia.com/gpu" not in limits and limits["cpu"] == 2 * 4
    else:
        assert limits == {"nvidia.com/gpu": kw["nproc_per_node"]}
    assert trainer["command"] == ["torchrun", "-m", "gpu_lab.rank.headless", ENTRY, "--config",
                                  "/etc/gpu_lab/config.json"]
    if "env" in kw:
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in trainer["env"]
        assert tj["metadata"]["namespace"] == "team-a"
    # the overrides mount what they declare, into the runtime's `node` job and container
    [override] = spec["podSpecOverrides"]
    assert override["targetJobs"] == [{"name": "node"}]
    [container] = override["containers"]
    volumes = {v["name"]: v for v in override["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    cm = _doc((tmp_path / "configmap.yaml").read_text())
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert TrainConfig.from_json(cm["data"]["config.json"]) == cfg
    runtime_file = tmp_path / "clustertrainingruntime.yaml"
    if define_runtime:
        rt = _doc(runtime_file.read_text())
        assert crd_schema.errors(rt, crds["ClusterTrainingRuntime"]) == []
        assert spec["runtimeRef"] == {"name": "gpu-lab-torch", "apiGroup": "trainer.kubeflow.org",
                                      "kind": "ClusterTrainingRuntime"}
        assert rt["metadata"]["name"] == "gpu-lab-torch"
        [rjob] = rt["spec"]["template"]["spec"]["replicatedJobs"]
        pod = rjob["template"]["spec"]["template"]["spec"]
        assert rjob["name"] == "node" and pod["containers"][0]["name"] == container["name"]
        assert pod["containers"][0]["image"] == "registry.example.com/t/train:2"
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                "sizeLimit": "8Gi"}}]
        assert "dshm" not in volumes  # the runtime has it; a second one would clash
        # the CEL rule this schema cannot express: numProcPerNode > 0 or auto / cpu / gpu
        npp = rt["spec"]["mlPolicy"]["torch"]["numProcPerNode"]
        assert (isinstance(npp, int) and npp > 0) or npp in ("auto", "cpu", "gpu")
        assert job.command.startswith("kubectl apply -f clustertrainingruntime.yaml")
    else:
        assert not runtime_file.exists()
        assert spec["runtimeRef"]["name"] == "torch-distributed"
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "PET_NNODES" in job.explanation and "/dev/shm" in job.explanation


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pytorchjob_validates_against_the_v1_crd(crds, shape):
    job = export(TrainConfig(), ENTRY, "kubernetes", **SHAPES[shape])
    doc = _doc(job.files["pytorchjob.yaml"])
    assert crd_schema.errors(doc, crds["PyTorchJob"]) == []
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert sum(r["replicas"] for r in replicas.values()) == SHAPES[shape]["num_nodes"]


def _set(path: str, value):
    """A mutation setting (or deleting) the field at a dotted path ("~" stands for "." in a key,
    as in nvidia~com/gpu)."""
    def mutate(doc):
        *parents, last = [k.replace("~", ".") for k in path.split(".")]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return mutate


_DELETE = object()
TRAINJOB_MISTAKES = {
    "misspelt field": (_set("spec.trainer.resourcesPerNod", {"limits": {"cpu": 1}}),
                       "'resourcesPerNod' was unexpected"),
    "field of another version": (_set("spec.trainer.numProcsPerNode", 8),
                                 "'numProcsPerNode' was unexpected"),
    "wrong type": (_set("spec.trainer.numNodes", "4"), "'4' is not of type 'integer'"),
    "missing required": (_set("spec.runtimeRef.name", _DELETE), "'name' is a required property"),
    "bad quantity": (_set("spec.trainer.resourcesPerNode.limits.nvidia~com/gpu", "lots"),
                     "nvidia.com/gpu"),
    "unknown metadata": (_set("metadata.uid", "x"), "'uid' was unexpected"),
    "deep unknown field": (_set("spec.podSpecOverrides.0.volumes.0.configMap.nam", "x"),
                           "'nam' was unexpected"),
    "wrong version": (_set("apiVersion", "trainer.kubeflow.org/v1"), "serves"),
    "wrong kind": (_set("kind", "PyTorchJob"), "'TrainJob'"),
}


@pytest.mark.parametrize("mistake", list(TRAINJOB_MISTAKES))
def test_the_strict_check_catches_an_injected_mistake(crds, mistake):
    mutate, needle = TRAINJOB_MISTAKES[mistake]
    good = _doc(export(TrainConfig(), ENTRY, "trainjob", num_nodes=2,
                       nproc_per_node=4).files["trainjob.yaml"])
    assert crd_schema.errors(good, crds["TrainJob"]) == []
    bad = copy.deepcopy(good)
    mutate(bad)
    found = crd_schema.errors(bad, crds["TrainJob"])
    assert found and any(needle in e for e in found), found


def test_the_strict_check_catches_mistakes_in_the_other_crds(crds):
    spec = JobSpec(ENTRY, num_nodes=2, nproc_per_node=2, define_runtime=True)
    from gpu_lab.export.trainjob import runtime_manifest

    rt = runtime_manifest(spec)
    assert crd_schema.errors(rt, crds["ClusterTrainingRuntime"]) == []
    rt["spec"]["mlPolicy"]["torch"]["numProcPerNod"] = "auto"
    assert any("'numProcPerNod' was unexpected" in e
               for e in crd_schema.errors(rt, crds["ClusterTrainingRuntime"]))
    pj = _doc(export(TrainConfig(), ENTRY, "kubernetes", num_nodes=2).files["pytorchjob.yaml"])
    pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resource"] = {"limits": {"nvidia.com/gpu": 1}}
    assert any("'resource' was unexpected" in e
               for e in crd_schema.errors(pj, crds["PyTorchJob"]))


def test_strict_schema_rules():
    schema = crd_schema.strict_schema({
        "type": "object",
        "properties": {
            "n": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"},
                                                                {"type": "string"}]},
            "q": {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+$"},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "empty": {"type": "object"},
            "m": {"type": "object", "additionalProperties": {"type": "string"}},
            "opt": {"type": "string", "nullable": True},
        }})
    import jsonschema

    v = jsonschema.Draft7Validator(schema)
    ok = {"n": 3, "q": "12", "free": {"anything": [1]}, "m": {"a": "b"}, "opt": None}
    assert list(v.iter_errors(ok)) == []
    assert list(v.iter_errors({"q": 12})) == []  # int-or-string: the pattern is for strings
    for bad in ({"q": "12Gi"}, {"empty": {"x": 1}}, {"m": {"a": 1}}, {"zzz": 1}, {"n": 1.5}):
        assert list(v.iter_errors(bad)), bad


def test_torchrun_reads_the_trainjob_command_with_trainers_pet_variables(monkeypatch):
    from torch.distributed.run import parse_args

    tj = _doc(export(TrainConfig(), ENTRY, "trainjob", num_nodes=4,
                     nproc_per_node=8).files["trainjob.yaml"])
    cmd = tj["spec"]["trainer"]["command"]
    # what Trainer's torch plugin puts in every node's environment
    for k, v in {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "3",
                 "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(k, v)
    assert cmd[0] == "torchrun"
    args = parse_args(cmd[1:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("4", "8", 3)
    assert (args.master_addr, args.master_port) == ("job-node-0-0.job", 29400)
    assert args.module and args.training_script == "gpu_lab.rank.headless"
    assert args.training_script_args == [ENTRY, "--config", "/etc/gpu_lab/config.json"]


@pytest.mark.parametrize("kwargs, words", [
    (dict(runtime="Torch_Distributed"), ["runtime", "'Torch_Distributed'", "Kubernetes name"]),
    (dict(runtime="torch-distributed", define_runtime=True), ["stock runtime", "runtime="]),
])
def test_bad_runtime_is_refused_before_anything_is_written(tmp_path, kwargs, words):
    with pytest.raises(ValueError) as info:
        export(TrainConfig(), ENTRY, "trainjob", out_dir=tmp_path / "out", **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert not (tmp_path / "out").exists()


def test_cli_exports_a_trainjob_with_its_runtime(tmp_path, capsys, monkeypatch, crds):
    from gpu_lab.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["export", "trainjob", "--entry", ENTRY, "--out", "job", "--nodes", "2",
               "--gpus-per-node", "4", "--define-runtime", "--runtime", "team-torch",
               "--image", "r.example.com/x:1"])
    assert rc == 0
    assert "# trainjob: kubectl apply -f clustertrainingruntime.yaml" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert files == ["clustertrainingruntime.yaml", "config.json", "configmap.yaml",
                     "trainjob.yaml"]
    tj = _doc((tmp_path / "job" / "trainjob.yaml").read_text())
    rt = _doc((tmp_path / "job" / "clustertrainingruntime.yaml").read_text())
    assert tj["spec"]["runtimeRef"]["name"] == rt["metadata"]["name"] == "team-torch"
    assert crd_schema.errors(tj, crds["TrainJob"]) == []
    assert crd_schema.errors(rt, crds["ClusterTrainingRuntime"]) == []
    assert json.loads((tmp_path / "job" / "config.json").read_text())["max_steps"] is None
    rc = main(["export", "trainjob"])
    err = capsys.readouterr().err
    assert rc == 2 and "--entry MODULE:FUNCTION is required" in err
