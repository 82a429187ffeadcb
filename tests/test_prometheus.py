"""A real Prometheus scrapes a real Jupyter server while a real 2-rank gpu_lab run trains.

Debian's `prometheus` (installed by `make test`) runs on loopback with three scrape jobs for the
server's /gpu-lab/metrics: one with the Jupyter token as a bearer token, one with it as the `token`
query parameter, one without it. The tests read Prometheus' HTTP API: the run's loss and training
series and the host and GPU series arrive with their labels, the tokenless job is down (403), and
every PromQL expression of the exported Grafana dashboard names series the endpoint exports and
returns data. GPUs: the real ones where NVML sees any, else two FakeNVML boards (a named double,
loaded into the server by tests/fake_gpus_ext.py). Nothing outlives the module: the fixture's
teardown checks that Prometheus, the server and every process of the run are gone.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpu_lab
import prometheus_fns
import prometheus_utils
from gpu_lab.telemetry.probe import gpu_count
from lab_utils import Lab, jupyter_lab
from proc_utils import alive, tree, wait_until

pytestmark = [
    pytest.mark.slow,  # starts processes (ranks, kernels, servers) or runs for seconds
    pytest.mark.skipif(not prometheus_utils.installed(), reason="Debian's prometheus is not "
                       "installed (`make test` installs it: target `prometheus`)")]

TESTS = Path(__file__).resolve().parent
JOBS = ("gpu_lab", "gpu_lab_token_param", "gpu_lab_no_token")
APPEAR = 120.0  # s: a loaded CI machine starts the server, the ranks and the first scrapes


@dataclass
class Stack:
    lab: Lab
    prom: prometheus_utils.Prometheus
    run: gpu_lab.Run
    target: str  # host:port of the Jupyter server, Prometheus' `instance` label


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "root").mkdir()
    cfg = tmp / "jupyter_config"
    cfg.mkdir()
    (cfg / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": {"gpu_lab": True, "fake_gpus_ext": True}}}))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH"))
                                         if p)}
    old_home = os.environ.get("GPU_LAB_HOME")
    procs: list = []
    with jupyter_lab(tmp, tmp / "root", env=env, name="prometheus-lab") as lab:
        os.environ["GPU_LAB_HOME"] = str(lab.gpu_lab_home)  # the run goes where the server reads
        try:
            # 2 gloo ranks on CPU; on a GPU host one rank per GPU, at most 2
            ranks = 2 if gpu_count() != 1 else 1
            run = gpu_lab.launch(prometheus_fns.report_until_stopped, num_processes=ranks,
                                 name="prom-scrape")
            assert run.wait_for_step(3, rank=ranks - 1, timeout=APPEAR), run.logs(None)
            procs = tree(run.pid)
            token = tmp / "token"
            token.write_text(lab.token)
            token.chmod(0o600)
            target = lab.url.split("//", 1)[1].rstrip("/")
            base = {"metrics_path": "/gpu-lab/metrics", "static_configs": [{"targets": [target]}]}
            jobs = [
                {"job_name": "gpu_lab", **base,
                 "authorization": {"type": "Bearer", "credentials_file": str(token)}},
                {"job_name": "gpu_lab_token_param", **base, "params": {"token": [lab.token]}},
                {"job_name": "gpu_lab_no_token", **base},
            ]
            with prometheus_utils.prometheus(tmp / "prom", jobs) as prom:
                yield Stack(lab, prom, run, target)
            assert run.stop() == "stopped"
        finally:
            if old_home is None:
                os.environ.pop("GPU_LAB_HOME", None)
            else:
                os.environ["GPU_LAB_HOME"] = old_home
    # no daemon outlives the test
    assert prom.proc.poll() is not None, "prometheus still running"
    assert lab.proc.poll() is not None, "the Jupyter server still running"
    wait_until(lambda: not alive(procs), 30, what="every process of the run to end")


def _vector(stack: Stack, expr: str, n: int = 1, timeout: float = APPEAR) -> list[dict]:
    """Poll an instant query until it returns at least n series."""
    def enough():
        result = stack.prom.query(expr)
        return result if len(result) >= n else None

    return wait_until(enough, timeout, interval=0.25,
                      what=f"{expr} in Prometheus (at least {n} series)")


def _value(sample: dict) -> float:
    return float(sample["value"][1])


def test_prometheus_scrapes_the_run_and_the_host_with_the_token(stack):
    rid = stack.run.id
    # the run's loss, through both ways of passing the token
    loss = {r["metric"]["job"]: r for r in _vector(
        stack, f'gpu_lab_run_last_loss{{run_id="{rid}"}}', n=2)}
    assert set(loss) == {"gpu_lab", "gpu_lab_token_param"}
    assert loss["gpu_lab"]["metric"] == {"__name__": "gpu_lab_run_last_loss", "job": "gpu_lab",
                                         "instance": stack.target, "run_id": rid}
    assert 0 < _value(loss["gpu_lab"]) <= 2.0
    [info] = _vector(stack, f'gpu_lab_run_info{{job="gpu_lab", run_id="{rid}"}}')
    assert (info["metric"]["name"], info["metric"]["status"]) == ("prom-scrape", "running")
    # the training series of an active run
    [sps] = _vector(stack, f'gpu_lab_run_samples_per_second{{job="gpu_lab", run_id="{rid}"}}')
    assert _value(sps) == 256.0
    [wait] = _vector(stack, f'gpu_lab_run_data_wait_ratio{{job="gpu_lab", run_id="{rid}"}}')
    assert _value(wait) == pytest.approx(0.25)
    [step] = _vector(stack, f'gpu_lab_run_last_step{{job="gpu_lab", run_id="{rid}"}}')
    assert _value(step) >= 3
    # host series
    [cpu] = _vector(stack, 'gpu_lab_host_cpu_percent{job="gpu_lab"}')
    assert cpu["metric"]["instance"] == stack.target and 0 <= _value(cpu) <= 100
    [ram] = _vector(stack, 'gpu_lab_host_memory_total_bytes{job="gpu_lab"}')
    assert _value(ram) > 0
    # GPU series under DCGM-exporter's names and labels
    n_gpus = gpu_count() or 2
    util = _vector(stack, 'DCGM_FI_DEV_GPU_UTIL{job="gpu_lab"}', n=n_gpus)
    assert len(util) == n_gpus
    for r in util:
        labels = r["metric"]
        assert {"gpu", "UUID", "device", "modelName", "Hostname"} <= set(labels), labels
        assert labels["device"] == f"nvidia{labels['gpu']}"
        assert labels["Hostname"] == socket.gethostname()
        assert 0 <= _value(r) <= 100
    if gpu_count() == 0:  # the FakeNVML boards
        assert {r["metric"]["modelName"] for r in util} == {"Fake H100 80GB HBM3"}
        [fb] = _vector(stack, 'DCGM_FI_DEV_FB_USED{job="gpu_lab", gpu="0"}')
        assert _value(fb) == 20 * 1024  # MiB, as DCGM counts
    for job in ("gpu_lab", "gpu_lab_token_param"):
        [up] = _vector(stack, f'up{{job="{job}"}} == 1')
        assert stack.prom.targets()[job]["health"] == "up"


def test_a_scrape_without_the_token_is_recorded_as_down(stack):
    [up] = _vector(stack, 'up{job="gpu_lab_no_token"}')
    wait_until(lambda: stack.prom.targets()["gpu_lab_no_token"]["lastError"], APPEAR,
               what="the tokenless scrape to fail")
    assert _value(stack.prom.query('up{job="gpu_lab_no_token"}')[0]) == 0
    target = stack.prom.targets()["gpu_lab_no_token"]
    assert target["health"] == "down" and "403" in target["lastError"], target
    assert stack.prom.query('{job="gpu_lab_no_token", __name__=~"gpu_lab_.*|DCGM_.*"}') == []
    assert up["metric"]["instance"] == stack.target


# --- the Grafana dashboard against the live scrape ------------------------------------------------
_OUR_SERIES = re.compile(r"\b(?:DCGM_FI_[A-Z0-9_]+|gpu_lab_[a-z0-9_]+)\b")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _exported_names(lab: Lab) -> set[str]:
    status, body, _ = lab.get("gpu-lab/metrics")
    assert status == 200, body[:500]
    return {ln.split()[2] for ln in body.decode().splitlines() if ln.startswith("# TYPE ")}


def _bind_variables(expr: str) -> str:
    """The expression as Grafana sends it with every variable on "All" (regex .*)."""
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def _expression_problems(expr: str, exported: set[str]) -> list[str]:
    names = _OUR_SERIES.findall(expr)
    if not names:
        return [f"{expr!r} names no gpu_lab_* or DCGM_FI_* series"]
    return [f"{expr!r}: {n} is not exported by /gpu-lab/metrics" for n in names
            if n not in exported]


def test_grafana_dashboard_queries_what_the_endpoint_exports(stack):
    out = subprocess.run([sys.executable, "-m", "gpu_lab.cli", "export", "grafana"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    board = json.loads(out.stdout)
    titles = {p["title"] for p in board["panels"] if p["type"] != "row"}
    assert {"GPU utilisation", "GPU memory used", "GPU power", "GPU temperature",
            "Loss per run", "Samples/s per run"} <= titles, titles
    exported = _exported_names(stack.lab)
    # the check can fail: a misspelt series is caught
    assert _expression_problems('DCGM_FI_DEV_GPU_UTILISATION{gpu=~"$gpu"}', exported)
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) == len(titles)
    problems = [msg for e in exprs for msg in _expression_problems(e, exported)]
    assert not problems, "\n".join(problems)
    for expr in exprs:  # valid PromQL, with data from the live scrape
        _vector(stack, _bind_variables(expr))
    variables = [v for v in board["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} == {"Hostname", "gpu", "run_id"}
    for v in variables:
        m = _LABEL_VALUES.match(v["query"])
        assert m, v["query"]
        assert not _expression_problems(m["selector"], exported)
        found = _vector(stack, _bind_variables(m["selector"]))
        assert all(m["label"] in r["metric"] for r in found), (v["name"], found[:2])
    # the run's own loss is among what the loss panel shows, named after the run
    loss_expr = next(t["expr"] for p in board["panels"] if p["title"] == "Loss per run"
                     for t in p["targets"])
    shown = _vector(stack, _bind_variables(loss_expr))
    assert any(r["metric"].get("run_id") == stack.run.id and r["metric"].get("name") ==
               "prom-scrape" for r in shown), shown
