"""Hugging Face Trainer, Lightning's Trainer and Fabric record into gpu_lab, and %%gpu_lab makes a
notebook cell the training function. Real libraries, real kernels (jupyter_client), 2 gloo ranks;
the training scripts (tests/own_code/train_hf.py, train_lightning.py, train_fabric.py) never
import gpu_lab."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts kernels and ranks that import transformers or Lightning

TESTS = Path(__file__).parent
HELPERS = """
import json, os, time
from gpu_lab.record.registry import Registry
from proc_utils import tree, alive, wait_until

def steps(run, name):
    return [m["step"] for m in Registry().metrics(run.id, name, rank=0)]

def ckpts(run):
    return [[c["step"], os.path.basename(c["path"]), c["exists"]] for c in run.checkpoints]

def notes(run):
    return [e["data"]["text"] for e in Registry().events(run.id, kinds=["log"])]

def stop_and_check(run):
    procs = tree(run.pid)
    status = run.stop()
    wait_until(lambda: not alive(procs), 20, what="the run's processes to end")
    return {"status": status, "n": len(procs), "left": [p.pid for p in procs if alive([p])]}
"""


def test_a_trainer_script_records_its_logs_config_checkpoints_and_resumes(kernels, tmp_path):
    k = kernels("import gpu_lab" + HELPERS)  # transformers is imported in the ranks, not here
    done = k.json(f"""
run = gpu_lab.launch("own_code/train_hf.py", "--out", {str(tmp_path / "a")!r}, "--steps", "20",
                     num_processes=2)
status = run.wait(300)
row = Registry().get_run(run.id)
print(json.dumps({{"status": status, "error": str(run.error), "loss": steps(run, "loss"),
                  "eval": steps(run, "eval_loss"), "lr": steps(run, "learning_rate"),
                  "config": {{k: row["config"].get(k) for k in ("max_steps", "learning_rate",
                             "per_device_train_batch_size", "output_dir", "logging_steps")}},
                  "ckpts": ckpts(run), "sys_modules": "transformers" in sys.modules,
                  "ranks": [json.load(open({str(tmp_path / "a")!r} + f"/rank{{r}}.json"))
                            for r in (0, 1)]}}))
""", timeout=360)
    assert done["status"] == "succeeded", done["error"]
    assert done["loss"] == list(range(2, 21, 2)) == done["lr"]  # every logging step, rank 0's
    assert done["eval"] == [10, 20]
    assert done["config"] == {"max_steps": 20, "learning_rate": 1e-3,
                              "per_device_train_batch_size": 8,
                              "output_dir": str(tmp_path / "a"), "logging_steps": 2}
    assert done["ckpts"] == [[10, "checkpoint-10", True], [20, "checkpoint-20", True]]
    assert [(r["world_size"], r["num_processes"], r["distributed_type"]) for r in done["ranks"]] \
        == [(2, 2, "MULTI_CPU")] * 2  # Trainer's own Accelerator sees the launch's world
    assert done["sys_modules"] is False  # the kernel never imported it

    # stopped after its first checkpoint, then resumed by run.resume() alone: it continues there
    out = tmp_path / "b"
    said = k.json(f"""
run = gpu_lab.launch("own_code/train_hf.py", "--out", {str(out)!r}, "--steps", "60",
                     "--pace", "0.1", num_processes=2)
wait_until(lambda: run.checkpoints or run.done, 300, what="a first checkpoint")
stopped = stop_and_check(run)
again = run.resume()
print(json.dumps({{"stopped": stopped, "ckpts": ckpts(run), "status": again.wait(300),
                  "error": str(again.error), "loss": steps(again, "loss"),
                  "notes": notes(again)}}))
""", timeout=700)
    assert said["stopped"]["status"] == "stopped" and said["stopped"]["left"] == [], said
    first = said["ckpts"][-1]
    assert first[1] == f"checkpoint-{first[0]}" and first[2], said["ckpts"]
    assert said["status"] == "succeeded", said["error"]
    # the resumed run's first logged step is the first one after the newest checkpoint
    assert said["loss"][0] == first[0] + 2 - first[0] % 2 and said["loss"][-1] == 60, said
    assert any(f"continues from {out}/checkpoint-{first[0]}" in n for n in said["notes"])


def test_lightning_trainer_and_fabric_record_and_stop(kernels, tmp_path):
    # Lightning imported in the kernel first: the ranks find it loaded and adopt it at once
    k = kernels("import gpu_lab, lightning" + HELPERS)
    said = k.json(f"""
out = {str(tmp_path)!r}
pl = gpu_lab.launch("own_code/train_lightning.py", "--out", out + "/pl", num_processes=2)
fab = gpu_lab.launch("own_code/train_fabric.py", "--out", out + "/fabric", num_processes=2)
res = {{}}
for key, run, name in (("pl", pl, "train_loss"), ("fabric", fab, "loss")):
    res[key] = {{"status": run.wait(300), "error": str(run.error), "steps": steps(run, name),
                "config": Registry().get_run(run.id)["config"], "ckpts": ckpts(run)}}
long = gpu_lab.launch("own_code/train_lightning.py", "--out", out + "/long", "--steps", "1000",
                      "--pace", "0.05", num_processes=2)
assert long.wait_for_step(3, metric="train_loss", timeout=300), long.status
res["stopped"] = stop_and_check(long)
fab_long = gpu_lab.launch("own_code/train_fabric.py", "--out", out + "/fab_long", "--steps",
                          "100000", "--pace", "0.05", num_processes=2)
assert fab_long.wait_for_step(3, timeout=300), fab_long.status
res["fabric_stopped"] = stop_and_check(fab_long)
wrong = gpu_lab.launch("own_code/train_lightning.py", "--out", out + "/wrong", "--devices", "4",
                       num_processes=2)
res["wrong"] = {{"status": wrong.wait(300), "error": str(wrong.error)}}
print(json.dumps(res))
""", timeout=900)
    pl, fab = said["pl"], said["fabric"]
    assert pl["status"] == "succeeded", pl["error"]
    assert pl["steps"] == list(range(1, 20, 2))  # self.log, every log_every_n_steps=2
    assert pl["config"] == {"lr": 0.05, "width": 16, "pace": 0.0}  # save_hyperparameters()
    assert [c[1].rsplit("-", 1)[-1] for c in pl["ckpts"]] == ["step=10.ckpt", "step=20.ckpt"]
    assert [c[0] for c in pl["ckpts"]] == [10, 20] and pl["ckpts"][-1][2]
    assert fab["status"] == "succeeded", fab["error"]
    assert fab["steps"] == list(range(20))  # fabric.log(..., step=step)
    assert fab["ckpts"] == [[19, "final.ckpt", True]]  # fabric.save, after its last step
    for key in ("stopped", "fabric_stopped"):
        assert said[key]["status"] == "stopped" and said[key]["left"] == [], said
    wrong = said["wrong"]
    assert wrong["status"] == "failed"
    assert "devices=4" in wrong["error"] and "world size (2)" in wrong["error"], wrong
    assert "num_processes=4" in wrong["error"], wrong  # gpu_lab's advice: the two ways out


MAGIC = """\
%%gpu_lab --ranks 2 --name from-a-cell --as trained
import time
from pathlib import Path
from accelerate import Accelerator
while not Path(GO).exists():  # the test creates it once this cell's reply has come
    time.sleep(0.05)
acc = Accelerator()
for step in range(5):
    acc.log({"loss": 1.0 / (step + 1), "width": WIDTH}, step=step)
"""


def test_the_cell_magic_runs_the_cell_on_ranks_and_frees_the_kernel(kernels, tmp_path):
    k = kernels("import gpu_lab" + HELPERS)
    go = tmp_path / "go"
    k.run(f"WIDTH = 7\nGO = {str(go)!r}")
    reply = k.kc.execute_interactive(MAGIC, timeout=120)  # returns while the ranks wait
    assert reply["content"]["status"] == "ok", reply["content"]
    assert not go.exists()
    go.touch()
    said = k.json("""
print(json.dumps({"status": trained.wait(120), "error": str(trained.error), "name": trained.name,
                  "loss": steps(trained, "loss"), "width": trained.metrics.last("width"),
                  "ranks": trained.num_processes}))
""")
    assert said == {"status": "succeeded", "error": "None", "name": "from-a-cell",
                    "loss": [0, 1, 2, 3, 4], "width": 7.0, "ranks": 2}, said


def _error(k, code: str) -> dict:
    reply = k.kc.execute_interactive(code, timeout=60)
    return reply["content"]


def test_the_cell_magic_says_what_was_wrong(kernels):
    k = kernels("import gpu_lab" + HELPERS)
    bad = _error(k, "%%gpu_lab --ranks 2 --gpu 1\npass")
    assert bad["status"] == "error" and bad["ename"] == "UsageError", bad
    assert "--gpu 1" in bad["evalue"] and "--gpus N|all|0,1" in bad["evalue"], bad
    assert "--ranks 0" in _error(k, "%%gpu_lab --ranks 0\npass")["evalue"]
    syntax = _error(k, "%%gpu_lab\ndef f(:\n    pass")
    assert syntax["ename"] == "SyntaxError" and "gpu_lab cell" in syntax["evalue"], syntax
    k.run("%%gpu_lab --as failing\nx = 1\nraise ValueError(f'at once, x={x}')")
    said = k.json("print(json.dumps({'status': failing.wait(120), 'error': str(failing.error), "
                  "'tb': failing.error.first.traceback}))")
    assert said["status"] == "failed", said
    # the exception, and the cell's own line in its traceback
    assert "ValueError: at once, x=1" in said["error"], said
    assert "raise ValueError(f'at once, x={x}')" in said["tb"], said["tb"]


HAND = {
    "hf": """
import gpu_lab, sys
sys.argv = ["by_hand_hf.py", "--out", sys.argv[1]]
import transformers
from own_code import train_hf
real = train_hf.Trainer
class Trainer(real):
    def __init__(self, *a, **kw):
        super().__init__(*a, callbacks=[*(kw.pop("callbacks") or []), gpu_lab.TrainerCallback()],
                         **kw)
train_hf.Trainer = Trainer
train_hf.main()
""",
    "lightning": """
import gpu_lab, sys, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from own_code.train_lightning import Model
x = torch.randn(64, 8); y = (x[:, 0] > 0).long()
trainer = L.Trainer(devices=1, accelerator="cpu", max_steps=6, log_every_n_steps=1,
                    logger=gpu_lab.LightningLogger(), default_root_dir=sys.argv[1],
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(lr=0.1, width=4, pace=0.0), DataLoader(TensorDataset(x, y), batch_size=8))
""",
}


def test_by_hand_outside_gpu_lab_each_records_a_run_of_its_own(tmp_path):
    from gpu_lab.record.registry import Registry

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    procs = {name: subprocess.Popen([sys.executable, "-c", textwrap.dedent(code),
                                     str(tmp_path / name)], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, code in HAND.items()}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    reg = Registry()
    rows = {r["name"]: r for r in reg.list_runs()}
    hf = rows["by_hand_hf.py"]
    assert hf["status"] == "succeeded"
    assert [m["step"] for m in reg.metrics(hf["id"], "loss", rank=0)] == list(range(2, 21, 2))
    assert hf["config"]["max_steps"] == 20
    assert [c["step"] for c in reg.checkpoints(hf["id"])] == [10, 20]
    pl = rows["-c"]  # python -c: no script name to call it by
    assert pl["status"] == "succeeded"
    assert [m["step"] for m in reg.metrics(pl["id"], "train_loss", rank=0)] == list(range(6))
    assert pl["config"]["width"] == 4
