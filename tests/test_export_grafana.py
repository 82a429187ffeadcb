"""`gpu-lab export grafana`: a dashboard JSON that Grafana imports as is (a datasource variable, no
unresolved inputs), with the panels the ops view needs, whose every series the server's exposition
exports (here from the exposition itself; tests/test_prometheus.py repeats it through a live
Prometheus scrape)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from gpu_lab.export.grafana import FILE, dashboard, dashboard_json

PANELS = {"GPU utilisation": "DCGM_FI_DEV_GPU_UTIL", "GPU memory used": "DCGM_FI_DEV_FB_USED",
          "GPU power": "DCGM_FI_DEV_POWER_USAGE", "GPU temperature": "DCGM_FI_DEV_GPU_TEMP",
          "Loss per run": "gpu_lab_run_last_loss",
          "Samples/s per run": "gpu_lab_run_samples_per_second"}
SERIES = re.compile(r"\b(?:DCGM_FI_[A-Z0-9_]+|gpu_lab_[a-z0-9_]+)\b")


def _panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def test_cli_prints_importable_json_and_writes_the_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpu_lab.cli", "export", "grafana"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    board = json.loads(out.stdout)  # nothing but JSON on stdout: `> dashboard.json` works
    assert board == dashboard()
    out = subprocess.run([sys.executable, "-m", "gpu_lab.cli", "export", "grafana", "--out",
                          str(tmp_path / "dash")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "dash" / FILE).read_text()) == board
    assert FILE in out.stdout


def test_dashboard_panels_and_datasource_variable():
    board = json.loads(dashboard_json())
    panels = _panels(board)
    by_title = {p["title"]: p for p in panels}
    for title, series in PANELS.items():
        [target] = by_title[title]["targets"]
        assert series in target["expr"], (title, target["expr"])
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ["GPUs", "Training runs"]
    # imports as is: no __inputs to resolve, the data source is a dashboard variable
    assert board["__inputs"] == [] and board["id"] is None and board["uid"] == "gpu-lab"
    [ds] = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert (ds["name"], ds["query"]) == ("DS_PROMETHEUS", "prometheus")
    text = json.dumps(board)
    refs = set(re.findall(r'"uid": "([^"]*)"', text)) - {"gpu-lab"}
    assert refs == {"${DS_PROMETHEUS}"}, refs
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels)
    # every variable a query uses is defined
    defined = {v["name"] for v in board["templating"]["list"]}
    used = set(re.findall(r"\$\{?(\w+)\}?", " ".join(
        [t["expr"] for p in panels for t in p["targets"]] +
        [v.get("query", "") for v in board["templating"]["list"]])))
    assert used <= defined, used - defined
    # GPU panels per GPU; units Grafana knows
    for title in ("GPU utilisation", "GPU memory used", "GPU power", "GPU temperature"):
        p = by_title[title]
        assert "{{gpu}}" in p["targets"][0]["legendFormat"]
    assert {by_title[t]["fieldConfig"]["defaults"]["unit"] for t in PANELS} == {
        "percent", "mbytes", "watt", "celsius", "none"}
    # a readable grid: unique ids, no two panels on the same cells
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        assert g["x"] + g["w"] <= 24
        cells |= mine


@pytest.fixture
def state_with_gpus_and_a_run(gpu_lab_home):
    """A server state whose sampler reads FakeNVML (a named double: no GPU here) and whose
    registry holds an active run with fit's training figures."""
    from gpu_lab.record.registry import Registry
    from gpu_lab.server.state import ServerState
    from gpu_lab.telemetry import NVMLSampler, Sampler
    from gpu_lab.telemetry.doubles import FakeNVML

    sampler = Sampler(gpu=NVMLSampler(nvml=FakeNVML(2), visible=None))
    reg = Registry()
    # an active run of this host whose supervisor is gone is marked lost: this process stands in
    reg.create_run("r1", name="demo", num_processes=2, status="running")
    reg.update("r1", pid=os.getpid(), pid_started=psutil.Process().create_time())
    reg.add_metrics([("r1", 0, 10, time.time(), k, v) for k, v in
                     (("loss", 0.7), ("samples_per_s", 100.0), ("step_time", 0.2),
                      ("data_wait", 0.02), ("lr", 0.1))])
    state = ServerState(sampler_factory=lambda: sampler)
    yield state
    state.close()
    sampler.close()


def test_every_series_of_the_dashboard_is_exported(state_with_gpus_and_a_run):
    from prometheus_client.parser import text_string_to_metric_families

    from gpu_lab.server.metrics import exposition

    body = exposition(state_with_gpus_and_a_run).decode()
    with_samples = {s.name for f in text_string_to_metric_families(body) for s in f.samples}
    board = dashboard()
    exprs = [t["expr"] for p in _panels(board) for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    named = {n for e in exprs for n in SERIES.findall(e)}
    assert named >= set(PANELS.values())
    assert named <= with_samples, named - with_samples
