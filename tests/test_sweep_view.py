"""The Sweep view in a real Jupyter kernel (nbclient): a sweep of tiny_cnn trials runs to its end,
then SweepView is displayed, and the widget state nbclient saved must hold the trials table, a
parallel-coordinates trace with one line per trial, and the top trials' curves.

Why a kernel: the view reaches the user as widget comm messages; only the saved state shows that
the table and the plotly figures were actually sent, not just built in Python."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

pytest.importorskip("optuna", reason="gpu_lab.sweep needs optuna (a dependency)")

TRIALS = 4

RUN = f"""
import json, gpu_lab
cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=20,
                          eval_every=5, num_workers=0, tensorboard=False, num_processes=1,
                          output_dir=OUTPUT_DIR)
space = {{"lr": gpu_lab.loguniform(1e-4, 1e-1), "optimizer": ["adamw", "sgd"]}}
sw = gpu_lab.sweep(gpu_lab.train_classifier, cfg, space, trials={TRIALS}, parallel=2,
                   metric="accuracy", pruner="asha", sampler_seed=0)
print("state:", sw.wait(timeout=400))
"""

SHOW = """
view = gpu_lab.SweepView(sw, top=3, live=False)
view
"""

IDS = """
print("RESULT " + json.dumps({"table": view.table.model_id,
      "parallel": [c.model_id for c in view.parallel.children],
      "curves": [c.model_id for c in view.curves.children], "statuses": [r["status"] for r in sw.trials]}))
"""


def _run(tmp_path: Path) -> tuple[dict, dict]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"OUTPUT_DIR = {str(tmp_path / 'out')!r}"),
                nbformat.v4.new_code_cell(RUN), nbformat.v4.new_code_cell(SHOW),
                nbformat.v4.new_code_cell(IDS)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=480, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [(i, o) for i, c in enumerate(nb.cells) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, "\n".join(f"cell {i}: {o['ename']}: {o['evalue']}" for i, o in errors)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs
                   if o.get("output_type") == "stream")
    assert "state: finished" in text, text
    line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return json.loads(line[len("RESULT "):]), state


@pytest.mark.timeout(600)  # kernel start + a 4-trial sweep on a loaded 2-core box
def test_sweep_view_renders_table_parcoords_and_curves(tmp_path, monkeypatch):
    for k, v in {"GPU_LAB_HOME": tmp_path / "home", "GPU_LAB_CLAIMS_DIR": tmp_path / "claims",
                 "GPU_LAB_CPU_SLOTS": 4, "GPU_LAB_QUICK": 1}.items():
        monkeypatch.setenv(k, str(v))  # the kernel and the sweep's driver inherit them
    ids, state = _run(tmp_path)
    table = state[ids["table"]]["state"]["value"]
    assert table.count("<tr>") == TRIALS + 1, table  # a head row and one per trial
    for status in ids["statuses"]:
        assert f"<td>{status}</td>" in table
    assert len(ids["parallel"]) == 1 and len(ids["curves"]) == 1, ids
    parcoords = state[ids["parallel"][0]]["state"]["_widget_data"]
    assert parcoords[0]["type"] == "parcoords"
    dims = parcoords[0]["dimensions"]
    assert [d["label"] for d in dims] == ["lr", "optimizer", "accuracy", "pruned"]
    assert all(len(d["values"]) == TRIALS for d in dims), dims
    curves = state[ids["curves"][0]]["state"]["_widget_data"]
    assert curves and all(t["type"] == "scatter" and len(t["y"]) > 0 for t in curves), curves
