"""Hostile values in every export field: each one is refused with a clear message before anything
is written, or it reaches the cluster commands exactly as given.

An accepted export runs the way a user runs it: its torchrun and accelerate commands,
`sbatch train.sbatch` and `kubectl apply ...` under bash, and the sbatch script itself under bash
as Slurm would run it on the node. The cluster commands (torchrun, accelerate, sbatch, srun,
scontrol, kubectl, python) are stand-ins on PATH that append their argv and environment as JSON
to a log. No file may appear, and every stand-in must see the value as given; a value that is
exactly $NAME or ${NAME} is expanded on purpose, so there the stand-in sees the variable's value
(HOME holds a space: it must stay one word). Every YAML file must parse to exactly the expected
objects, and Kubernetes' own $(VAR) expansion of an env value must give the value back. The
same cases go through `gpu-lab export` in process, and a few through a real `gpu-lab` process.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from gpu_lab.cluster import sandbox
from gpu_lab.config import TrainConfig
from gpu_lab.export import export

TESTS = Path(__file__).parent
ROOT = TESTS.parent
ENTRY = "export_fns:train_tiny"
SHAPE = dict(num_nodes=2, nproc_per_node=2, define_runtime=True)
CLI_SHAPE = ["--nodes", "2", "--gpus-per-node", "2", "--define-runtime"]
HOSTILE = [
    "a\nb", "a\rb", "x\x00y", "\x1b[31mred", "a\x7fb", "tab\there", "line\u2028sep", "c1\x85",
    "$(touch pwned)", "`touch pwned`", "x; touch pwned", "x && touch pwned", "x || touch pwned",
    "x | tee pwned", "x > pwned", "<(touch pwned)", "'; touch pwned; '", '"; touch pwned; "',
    "it's", 'say "hi"', "a b", " lead and trail ", "a$HOME", "$HOME/x", "${HOME:-x}", "$((6*7))",
    "\\$(touch pwned)", "$'\\x41'", "*", "~", "#not a comment", "a: b # c", "--flag", "-", "",
    "é ü 中", "!!", "$HOME", "${HOME}",
]
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
REF = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _printable(v: str) -> bool:
    return not CONTROL.search(v)


def _word(v: str) -> bool:  # what python and config_path accept: printable, no option look
    return bool(v) and _printable(v) and not v.startswith("-")


def _never(v: str) -> bool:
    return False


@dataclass(frozen=True)
class Field:
    label: str                             # what a refusal must name
    api: Callable[[str], dict]             # the export() keywords that set the field
    cli: Callable[[str], list] | None      # the `gpu-lab export` options that set it
    accepts: Callable[[str], bool]         # which HOSTILE values it must take (else: refuse)
    benign: str                            # a valid value, shown to arrive intact


def _opt(flag: str) -> Callable[[str], list]:
    return lambda v: [f"{flag}={v}"]  # `--x=VALUE`: argparse takes a VALUE that starts with '-'


FIELDS = {
    "env_value": Field("JobSpec.env", lambda v: {"env": {"HOSTILE": v}},
                       lambda v: [f"--env=HOSTILE={v}"], _printable, "NCCL_DEBUG=WARN"),
    "env_name": Field("env", lambda v: {"env": {v: "1"}}, lambda v: [f"--env={v}=1"],
                      _never, "_OK_9"),
    "name": Field("JobSpec.name", lambda v: {"name": v}, _opt("--name"), _never, "my-job-1"),
    "partition": Field("JobSpec.partition", lambda v: {"partition": v}, _opt("--partition"),
                       _never, "gpu,debug"),
    "account": Field("JobSpec.account", lambda v: {"account": v}, _opt("--account"), _never,
                     "proj_42.x"),
    "qos": Field("JobSpec.qos", lambda v: {"qos": v}, _opt("--qos"), _never, "high-prio"),
    "time_limit": Field("JobSpec.time_limit", lambda v: {"time_limit": v}, _opt("--time"),
                        _never, "1-12:30:00"),
    "image": Field("JobSpec.image", lambda v: {"image": v}, _opt("--image"), _never,
                   "registry.example.com:5000/team/train_x:1.2@sha256:" + "ab" * 32),
    "namespace": Field("JobSpec.namespace", lambda v: {"namespace": v}, _opt("--namespace"),
                       _never, "team-a"),
    "runtime": Field("JobSpec.runtime", lambda v: {"runtime": v}, _opt("--runtime"), _never,
                     "team.torch-v2"),
    "shm_size": Field("JobSpec.shm_size", lambda v: {"shm_size": v}, _opt("--shm-size"),
                      _never, "512Mi"),
    "master_addr": Field("JobSpec.master_addr", lambda v: {"master_addr": v},
                         _opt("--master-addr"), lambda v: REF.fullmatch(v) is not None,
                         "node0.cluster"),
    "entry": Field("entry", lambda v: {"entry": v}, _opt("--entry"), _never, ENTRY),
    "config_path": Field("JobSpec.config_path", lambda v: {"config_path": v}, None, _word,
                         "cfg/train.json"),
    "python": Field("JobSpec.python", lambda v: {"python": v}, None, _word, "/opt/py/bin/python3"),
}
CASES = [(f, i) for f in FIELDS for i in range(len(HOSTILE) + 1)]  # index len(HOSTILE): benign


def _value(field: str, i: int) -> str:
    return FIELDS[field].benign if i == len(HOSTILE) else HOSTILE[i]


def _kwargs(field: str, v: str) -> dict:
    if field == "env_value" and v == FIELDS[field].benign:
        return {"env": {"NCCL_DEBUG": "WARN"}}
    return FIELDS[field].api(v)


def _must_accept(field: str, i: int) -> bool:
    return i == len(HOSTILE) or FIELDS[field].accepts(HOSTILE[i])


def _export(kw: dict, out: Path):
    kw = dict(SHAPE, **kw)
    entry = kw.pop("entry", ENTRY)
    return export(TrainConfig(), entry, "all", out_dir=out, **kw)


# ------------------------------------------------------------------------ stand-ins and runs
STANDIN = '''#!{python} -IS
"""Stand-in for a cluster command: appends its argv and environment to $STANDIN_LOG."""
import json, os, shlex, sys

def directives(script):  # as sbatch reads them: #SBATCH lines before the first command
    out = []
    with open(script) as f:
        for line in f.read().splitlines()[1:]:
            if line.startswith("#SBATCH"):
                out += shlex.split(line[len("#SBATCH"):])
            elif line.strip() and not line.startswith("#"):
                break
    return out

prog = os.path.basename(sys.argv[0])
rec = {{"prog": prog, "argv": sys.argv[1:], "env": dict(os.environ)}}
if prog == "sbatch":
    rec["directives"] = directives(sys.argv[-1])
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
if prog == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(sys.argv[3].split(",")))
'''
STANDINS = ("torchrun", "accelerate", "sbatch", "srun", "scontrol", "kubectl", "python")


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    """The stand-ins on PATH and the environment the exported files run in."""
    d = tmp_path_factory.mktemp("standins")
    (d / "bin").mkdir()
    for name in STANDINS:
        p = d / "bin" / name
        p.write_text(STANDIN.format(python=sys.executable))
        p.chmod(0o755)
    home = d / "home dir"
    home.mkdir()
    env = {"PATH": f"{d / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(home),
           "LANG": "C.UTF-8", "STANDIN_LOG": str(d / "log.jsonl"), "MASTER_ADDR": "10.0.0.7",
           "NODE_RANK": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node0,node1",
           "SLURM_CPUS_PER_TASK": "1"}
    return {"env": env, "log": d / "log.jsonl"}


def _expand(v: str, env: dict) -> str:
    """What the stand-in must see for `v`: the variable's value for an exact reference."""
    m = REF.fullmatch(v)
    return env[m.group(1) or m.group(2)] if m else v


def _bash(bench: dict, cwd: Path, *argv: str) -> list[dict]:
    """Run bash with `argv` in `cwd`; the stand-ins' records, in order."""
    bench["log"].write_text("")
    out = subprocess.run(["bash", *argv], cwd=cwd, env=bench["env"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-2000:])
    return [json.loads(line) for line in bench["log"].read_text().splitlines()]


def _files(root: Path, skip: Path) -> set:
    return {p for p in root.rglob("*") if p != skip}


# ---------------------------------------------------------------------- what must arrive
def _expected_runs(kw: dict, env: dict) -> dict:
    """target -> [(prog, argv)] that each exported command must make the stand-ins see."""
    cfg = _expand(kw.get("config_path", "config.json"), env)
    addr = kw.get("master_addr", "$MASTER_ADDR")
    tail = ["-m", "gpu_lab.rank.headless", kw.get("entry", ENTRY), "--config", cfg]
    name = kw.get("name", "gpu-lab-tiny-cnn")
    accel = ["launch", "--config_file", "accelerate_config.yaml", "--machine_rank", "1"]
    if REF.fullmatch(addr):
        accel += ["--main_process_ip", _expand(addr, env)]
    apply = ["apply", "-f", "configmap.yaml"]
    return {
        "torchrun": [("torchrun", ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint={_expand(addr, env)}:29400",
                                   f"--rdzv-id={name}"] + tail)],
        "accelerate": [("accelerate", accel + tail)],
        "slurm": [("sbatch", ["train.sbatch"])],
        "kubernetes": [("kubectl", apply + ["-f", "pytorchjob.yaml"])],
        "trainjob": [("kubectl", ["apply", "-f", "clustertrainingruntime.yaml", "-f",
                                  "configmap.yaml", "-f", "trainjob.yaml"])],
        "script": [("scontrol", ["show", "hostnames", "node0,node1"]),
                   ("srun", [_expand(kw.get("python", "python"), env)] + tail)],
    }


def _expected_directives(kw: dict) -> list[str]:
    out = [f"--job-name={kw.get('name', 'gpu-lab-tiny-cnn')}", "--nodes=2",
           "--ntasks-per-node=2", "--gres=gpu:2", "--cpus-per-task=8",
           f"--time={kw.get('time_limit', '24:00:00')}", "--signal=SIGUSR1@90", "--requeue",
           "--open-mode=append", "--output=%x-%j.out"]
    return out + [f"--{k}={kw[k]}" for k in ("partition", "account", "qos") if k in kw]


def _check_runs(jobs: dict, kw: dict, bench: dict, job_dir: Path) -> None:
    env = bench["env"]
    expected = _expected_runs(kw, env)
    seen = {t: _bash(bench, job_dir, "-c", jobs[t].command) for t in jobs}
    seen["script"] = _bash(bench, job_dir, "train.sbatch")
    for target, runs in expected.items():
        got = seen[target]
        assert [(r["prog"], r["argv"]) for r in got] == runs, (target, jobs.get(target))
        if target in ("torchrun", "accelerate", "script"):
            for k, v in kw.get("env", {}).items():
                assert got[-1]["env"][k] == _expand(v, env), (target, k, v)
    assert seen["slurm"][0]["directives"] == _expected_directives(kw)
    assert seen["script"][-1]["env"]["MASTER_ADDR"] == "node0"


def k8s_expand(v: str) -> str:
    """What the kubelet makes of an env value (k8s.io/kubernetes third_party/forked/golang/
    expansion): `$$` is `$`, `$(NAME)` a variable (none is defined here, so it stays)."""
    out, i = [], 0
    while i < len(v):
        if v[i] == "$" and i + 1 < len(v):
            nxt = v[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(" and ")" in v[i + 2:]:
                j = v.index(")", i + 2)
                out.append(v[i:j + 1])  # an undefined variable is left as written
                i = j + 1
                continue
        out.append(v[i])
        i += 1
    return "".join(out)


def _meta(name: str, ns: str | None, labels: bool = True) -> dict:
    out: dict = {"name": name}
    if ns:
        out["namespace"] = ns
    if labels:
        out["labels"] = {"app.kubernetes.io/created-by": "gpu_lab"}
    return out


GPUS = {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 2}}
CONFIG_MOUNT = {"name": "config", "mountPath": "/etc/gpu_lab", "readOnly": True}
CMD_TAIL = ["-m", "gpu_lab.rank.headless", ENTRY, "--config", "/etc/gpu_lab/config.json"]


def _expected_pytorchjob(kw: dict, env: list) -> dict:
    name, image = kw.get("name", "gpu-lab-tiny-cnn"), kw.get("image", "gpu-lab:latest")
    container = {
        "name": "pytorch", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=$(RANK)",
                    "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)", *CMD_TAIL],
        "env": env, "resources": GPUS,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, CONFIG_MOUNT]}
    pod = {"containers": [container], "volumes": [
        {"name": "dshm", "emptyDir": {"medium": "Memory",
                                      "sizeLimit": kw.get("shm_size", "16Gi")}},
        {"name": "config", "configMap": {"name": f"{name}-config"}}]}
    replica = {"restartPolicy": "OnFailure", "template": {"spec": pod}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": _meta(name, kw.get("namespace")),
            "spec": {"runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": {"Master": dict(replica, replicas=1),
                                             "Worker": dict(replica, replicas=1)}}}


def _expected_trainjob(kw: dict, env: list) -> dict:
    name = kw.get("name", "gpu-lab-tiny-cnn")
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _meta(name, kw.get("namespace")),
            "spec": {
                "runtimeRef": {"name": kw.get("runtime", "gpu-lab-torch"),
                               "apiGroup": "trainer.kubeflow.org",
                               "kind": "ClusterTrainingRuntime"},
                "trainer": {"image": kw.get("image", "gpu-lab:latest"),
                            "command": ["torchrun", *CMD_TAIL], "env": env, "numNodes": 2,
                            "numProcPerNode": 2, "resourcesPerNode": GPUS},
                "podSpecOverrides": [{
                    "targetJobs": [{"name": "node"}],
                    "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}],
                    "containers": [{"name": "node", "volumeMounts": [CONFIG_MOUNT]}]}]}}


def _expected_runtime(kw: dict) -> dict:
    pod = {"containers": [{"name": "node", "image": kw.get("image", "gpu-lab:latest"),
                           "imagePullPolicy": "IfNotPresent",
                           "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": kw.get("shm_size", "16Gi")}}]}
    job = {"name": "node", "template": {
        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
        "spec": {"template": {"spec": pod}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
            "metadata": {"name": kw.get("runtime", "gpu-lab-torch"),
                         "labels": {"trainer.kubeflow.org/framework": "torch",
                                    "app.kubernetes.io/created-by": "gpu_lab"}},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
                     "template": {"spec": {"failurePolicy": {"maxRestarts": 3},
                                           "replicatedJobs": [job]}}}}


def _expected_accelerate(kw: dict) -> dict:
    out = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
           "num_machines": 2, "num_processes": 4, "machine_rank": 0, "mixed_precision": "no",
           "use_cpu": False, "gpu_ids": "all", "downcast_bf16": "no", "debug": False,
           "enable_cpu_affinity": False, "main_training_function": "main", "tpu_env": [],
           "tpu_use_cluster": False, "tpu_use_sudo": False, "main_process_port": 29400,
           "rdzv_backend": "c10d", "same_network": True}
    addr = kw.get("master_addr", "$MASTER_ADDR")
    if not REF.fullmatch(addr):
        out["main_process_ip"] = addr
    return out


def _check_yaml(kw: dict, job_dir: Path) -> None:
    def load(name: str) -> dict:
        [doc] = list(yaml.safe_load_all((job_dir / name).read_text(encoding="utf-8")))
        return doc

    given = dict(PYTHONUNBUFFERED="1", **kw.get("env", {}))
    env = [{"name": k, "value": v.replace("$", "$$")} for k, v in given.items()]
    assert load("pytorchjob.yaml") == _expected_pytorchjob(kw, env)
    assert load("trainjob.yaml") == _expected_trainjob(kw, env)
    assert load("clustertrainingruntime.yaml") == _expected_runtime(kw)
    assert load("accelerate_config.yaml") == _expected_accelerate(kw)
    for doc in (load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
            "spec"]["containers"][0], load("trainjob.yaml")["spec"]["trainer"]):
        assert {e["name"]: k8s_expand(e["value"]) for e in doc["env"]} == given
    cm = load("configmap.yaml")
    assert {k: cm[k] for k in ("apiVersion", "kind", "metadata")} == {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(kw.get("name", "gpu-lab-tiny-cnn") + "-config", kw.get("namespace"),
                          labels=False)}
    assert cm["data"] == {"config.json": (job_dir / "config.json").read_text()}
    assert TrainConfig.from_json(cm["data"]["config.json"]) == TrainConfig()


# --------------------------------------------------------------------------------- the tests
def _check_refusal(field: str, v: str, message: str) -> None:
    assert FIELDS[field].label in message, (field, v, message)
    empty = v == "" and ("required" in message or "empty" in message)
    assert repr(v) in message or empty, (field, v, message)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("field, i", CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_api_refuses_or_passes_the_value_intact(field, i, bench, tmp_path):
    v = _value(field, i)
    kw = _kwargs(field, v)
    job_dir = tmp_path / "job"
    if not _must_accept(field, i):
        with pytest.raises((ValueError, TypeError)) as info:
            _export(kw, job_dir)
        _check_refusal(field, v, str(info.value))
        assert not job_dir.exists(), "refused, but files were written"
        return
    jobs = _export(kw, job_dir)
    before = _files(tmp_path, bench["log"])
    _check_runs(jobs, kw, bench, job_dir)
    _check_yaml(kw, job_dir)
    assert _files(tmp_path, bench["log"]) == before, "running the export created files"
    assert not list(tmp_path.rglob("pwned"))


CLI_CASES = [(f, i) for f, i in CASES if FIELDS[f].cli is not None]


@pytest.mark.parametrize("field, i", CLI_CASES, ids=[f"{f}-{i}" for f, i in CLI_CASES])
def test_cli_refuses_with_exit_2_or_writes_what_the_api_writes(field, i, tmp_path, capsys,
                                                               monkeypatch):
    from gpu_lab.cli import main

    v = _value(field, i)
    argv = FIELDS[field].cli(v)
    if field == "env_value" and i == len(HOSTILE):
        argv = [f"--env={v}"]
    if field != "entry":
        argv = ["--entry", ENTRY] + argv
    monkeypatch.chdir(tmp_path)
    rc = main(["export", "all", "--out", "cli", *CLI_SHAPE, *argv])
    err = capsys.readouterr().err
    if not _must_accept(field, i):
        assert rc == 2, (field, v, err)
        _check_refusal(field, v, err)
        assert not (tmp_path / "cli").exists()
        return
    assert rc == 0, err
    _export(_kwargs(field, v), tmp_path / "api")
    for p in (tmp_path / "api").iterdir():
        assert (tmp_path / "cli" / p.name).read_text() == p.read_text(), p.name


def _gpu_lab(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    return subprocess.run([sys.executable, "-m", "gpu_lab.cli", "export", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_gpu_lab_process_refuses_a_split_partition_and_quotes_env(bench, tmp_path):
    """The issue's own examples, through a real `gpu-lab export` process."""
    out = _gpu_lab(tmp_path, "slurm", "--entry", ENTRY, "--partition", "gpu\ntouch X",
                   "--out", "bad")
    assert out.returncode == 2 and "JobSpec.partition" in out.stderr
    assert repr("gpu\ntouch X") in out.stderr and not (tmp_path / "bad").exists()
    env = {"X": "$(touch pwned)", "Y": "a b 'c' \"d\" #e", "Z": "$HOME", "W": "a$HOME"}
    out = _gpu_lab(tmp_path, "all", "--entry", ENTRY, "--out", "job", *CLI_SHAPE,
                   *[a for k, v in env.items() for a in ("--env", f"{k}={v}")])
    assert out.returncode == 0, out.stderr
    jobs = _export({"env": env}, tmp_path / "api")
    for p in (tmp_path / "api").iterdir():
        assert (tmp_path / "job" / p.name).read_text() == p.read_text(), p.name
    before = _files(tmp_path, bench["log"])
    _check_runs(jobs, {"env": env}, bench, tmp_path / "job")
    _check_yaml({"env": env}, tmp_path / "job")
    assert _files(tmp_path, bench["log"]) == before and not list(tmp_path.rglob("pwned"))
    seen = _bash(bench, tmp_path / "job", "train.sbatch")[-1]["env"]
    assert (seen["X"], seen["Y"], seen["Z"], seen["W"]) == (
        "$(touch pwned)", "a b 'c' \"d\" #e", bench["env"]["HOME"], "a$HOME")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sandbox.installed(),
                    reason="Slurm is not installed (`make test` installs Debian's slurmctld, slurmd, "
                           "slurm-client and munge)")
@pytest.mark.slow  # over half a second
def test_real_sbatch_reads_every_directive_of_a_script_with_hostile_env(tmp_path):
    """A private one-node cluster: `sbatch --test-only` accepts the script with every optional
    directive and hostile (accepted) env values, and refuses the same script for a partition it
    does not have, so the directives reach Slurm as written."""
    env = {f"V{i}": v for i, v in enumerate(HOSTILE) if _printable(v)}
    kw = dict(device="cpu", nproc_per_node=1, cpus_per_task=1, time_limit="00:05:00",
              name="hostile-ok", account="proj42", qos="normal", env=env)
    for part in ("debug", "nosuch"):
        export(TrainConfig(), ENTRY, "slurm", partition=part, out_dir=tmp_path / part, **kw)
    with sandbox.private_cluster(tmp_path / "slurm") as senv:
        runs = {part: subprocess.run(["sbatch", "--test-only", "train.sbatch"],
                                     cwd=tmp_path / part, env=senv, capture_output=True,
                                     text=True, timeout=60) for part in ("debug", "nosuch")}
    ok, bad = runs["debug"], runs["nosuch"]
    assert ok.returncode == 0 and "in partition debug" in ok.stderr, ok.stdout + ok.stderr
    assert bad.returncode != 0 and "nosuch" in bad.stderr, bad.stdout + bad.stderr
    assert not list(tmp_path.rglob("pwned"))


@pytest.mark.parametrize("i", range(len(HOSTILE)))
def test_hostile_config_strings_survive_config_json_and_the_configmap(i):
    """TrainConfig travels as JSON (config.json, and inside the ConfigMap as a YAML string):
    a string field with any of the hostile values comes back equal."""
    cfg = TrainConfig(data_dir=HOSTILE[i], output_dir="out" + HOSTILE[-1 - i])
    job = export(cfg, ENTRY, "kubernetes")
    [cm] = list(yaml.safe_load_all(job.files["configmap.yaml"]))
    assert cm["data"]["config.json"] == job.files["config.json"]
    assert TrainConfig.from_json(job.files["config.json"]) == cfg
