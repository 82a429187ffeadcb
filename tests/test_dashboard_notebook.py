"""The dashboard in a real Jupyter kernel (nbclient), the way a user meets it.

A notebook makes a LaunchPanel, clicks its Launch button from code, lets a 2-rank CPU run of
gpu_lab.train.train_classifier finish, then checks inside the kernel that the LivePlot's loss traces
hold points from both ranks and that the GPUPanel shows host metrics.

Why a kernel and not just pytest's process: ipykernel 7 routes output and comm messages sent from
background threads by the context of the cell that started the thread. Every update here comes
from such a thread (the event receiver's tick, the telemetry sampler). The widget state that
nbclient records (from the comm messages on IOPub parented to the executing cell) therefore proves
that trait updates made on those threads reached the frontend's channel. Plotly's restyle deltas
are not part of that saved state, so the plotted points are checked in the kernel.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).resolve().parent

SETUP = """
import json, time
from gpu_lab import TrainConfig
from gpu_lab.widgets import LaunchPanel

FINAL = ("succeeded", "failed", "stopped", "lost")
cfg = TrainConfig(model="tiny_cnn", max_steps=12, batch_size=16, image_size=16, num_classes=4,
                  num_workers=0, num_processes=2, augment="none", log_every=1, eval_every=0,
                  tensorboard=False, checkpoint_every=0, resume=False, output_dir=OUTPUT_DIR)
panel = LaunchPanel(TRAIN_FN, config=cfg)  # TRAIN_FN None: gpu_lab.train.train_classifier
panel
"""

# One cell: click, then wait. Updates sent from the receiver and sampler threads are parented to
# this cell (the one that started those threads), so nbclient records them while it runs.
LAUNCH_AND_WAIT = """
panel.launch_button.click()
run = panel.run
assert run is not None, panel.status.value
deadline = time.time() + 240
run.wait(240)
lp, gp = panel.dashboard.liveplot, panel.dashboard.gpupanel
while time.time() < deadline and not (lp.trace_points("loss", 0) and lp.trace_points("loss", 1)):
    time.sleep(0.1)   # the last points are drawn on the receiver's next tick
while time.time() < deadline and (gp.listening or panel.launch_button.disabled):
    time.sleep(0.1)   # the dashboard stops telemetry and re-enables Launch once the run has ended
print("status:", run.status)
"""

CHECK = """
loss = {t.meta["rank"]: len(t.y) for t in lp.fig.data if t.meta["metric"] == "loss"}
host = {t.meta["metric"]: len(t.y) for t in gp.host_fig.data}
assert run.status == "succeeded", (run.status, str(run.error), run.logs(0, 30))
assert loss.get(0, 0) > 0 and loss.get(1, 0) > 0, loss
assert host["cpu_pct"] > 0 and host["ram_pct"] > 0, host
assert "<b>host</b> · CPU" in gp.table.value and " GiB" in gp.table.value
from gpu_lab.readers import get_receiver
print("RESULT " + json.dumps({
    "loss_points": loss, "host_points": host, "status": run.status,
    "status_line_id": panel.dashboard.info.status_line.model_id,
    "table_id": gp.table.model_id, "launch_disabled": panel.launch_button.disabled,
    "liveplot_flushes": lp.flushes, "receiver_errors": get_receiver().errors,
    "reported_loss_points": run.metrics.count("loss"),
}))
"""


def _notebook(train_fn: str, output_dir: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    head = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nTRAIN_FN = {train_fn}\nOUTPUT_DIR = {output_dir!r}"
    nb.cells = [nbformat.v4.new_code_cell(head),
                nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(LAUNCH_AND_WAIT),
                nbformat.v4.new_code_cell(CHECK)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _run_notebook(tmp_path: Path, train_fn: str) -> tuple[nbformat.NotebookNode, dict]:
    nb = _notebook(train_fn, str(tmp_path / "out"))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [(i, o) for i, c in enumerate(nb.cells) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, "\n".join(f"cell {i}: {o['ename']}: {o['evalue']}\n" + "\n".join(
        o.get("traceback", [])[-5:]) for i, o in errors)
    text = "".join(o.get("text", "") for o in nb.cells[3].outputs if o.get("output_type") == "stream")
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"no RESULT line; outputs: {nb.cells[3].outputs}"
    return nb, json.loads(line[len("RESULT "):])


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_LAB_HOME", str(tmp_path / "home"))  # the kernel inherits it
    return tmp_path


@pytest.mark.timeout(480)  # kernel start + 2-rank run on a loaded 2-core CI box; typically ~30 s
def test_launchpanel_in_a_real_kernel(kernel_env):
    nb, result = _run_notebook(kernel_env, train_fn=os.environ.get("GPU_LAB_TEST_TRAIN_FN", "None"))
    assert result["status"] == "succeeded"
    assert result["loss_points"]["0"] > 0 and result["loss_points"]["1"] > 0
    assert result["host_points"]["cpu_pct"] > 0 and result["host_points"]["ram_pct"] > 0
    assert not result["launch_disabled"] and result["receiver_errors"] == 0
    # The trait updates made on the background threads reached IOPub, parented to the cell that
    # started those threads: nbclient recorded them into the saved widget state.
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    table = state[result["table_id"]]["state"]["value"]
    assert "<b>host</b> · CPU" in table                   # written by the sampler thread
    status_line = state[result["status_line_id"]]["state"]["value"]
    assert "succeeded" in status_line                     # written by the receiver thread
    # cell 2 prints only its own line: nothing from the threads leaked into the outputs as text
    texts = [o.get("text", "") for o in nb.cells[2].outputs if o.get("output_type") == "stream"]
    assert not any("Traceback" in t or "Exception in thread" in t for t in texts), texts
