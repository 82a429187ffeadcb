"""Tensors follow the model, tested on a CPU: with GPU_LAB_STRICT_DEVICE=1 (which the notebooks
tier sets for every tutorial) each launched rank treats the model's device as a device of its own,
so an input left on the CPU fails here as it fails on a GPU. The two examples the machine-shapes
review found, as the tutorials had them, fail from a real kernel; as the tutorials have them now,
they pass."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow  # a real kernel launches ranks

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# 00_your_own_code's %%gpu_lab cell as it was: x made on the CPU after acc.prepare moved the model
OWN_CELL_BEFORE = '''%%gpu_lab --ranks {tutorial.ranks()} --name own-cell --as cell_run
import torch
from accelerate import Accelerator

acc = Accelerator()
acc.init_trackers("cell", config={"lr": LR})
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=LR)
model, opt = acc.prepare(model, opt)
x = torch.randn(256, 4)
y = x.sum(1, keepdim=True)
for step in range(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    acc.log({"loss": loss.item()}, step=step)
acc.end_training()'''

# 08's training step as it was: the batch made on the CPU after acc.prepare
OOM_STEP_BEFORE = '''CAP = 128 * 2**20


def train_step(batch_size, accum=1, image_size=32):
    import torch
    import torch.nn.functional as F
    from gpu_lab.diagnostics import memory_cap, note
    from gpu_lab.models import build

    acc = gpu_lab.accelerator(gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    model = build("tiny_resnet", num_classes=4, image_size=image_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(acc.process_index)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, 4, (batch_size,), generator=g)
    micro = batch_size // accum
    note(batch_size=micro, grad_accum_steps=accum, num_processes=acc.num_processes)
    with memory_cap(CAP):
        for x, y in zip(images.split(micro), labels.split(micro)):
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    return {"micro_batch": micro, "accumulation": accum, "loss": round(float(loss), 4)}'''

SETUP = ("import os\nos.environ['GPU_LAB_STRICT_DEVICE'] = '1'  # the ranks inherit it\n"
         "import gpu_lab\nfrom gpu_lab import tutorial\nLR = 0.05\nRANKS = tutorial.ranks()")


def _cell(notebook: str, marker: str) -> str:
    nb = nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and marker in c.source)


def _definitions(source: str) -> str:
    """A cell's code before its first launch: the constants and the training function."""
    return source[:source.index("\n", source.rindex("\n", 0, source.index("gpu_lab.launch(")))]


def _status(k, run: str) -> dict:
    return k.json(f"print(json.dumps({{'status': {run}.wait(300), 'error': str({run}.error)}}))",
                  timeout=330)


def test_the_cell_magic_example_keeps_its_input_on_the_models_device(kernels):
    k = kernels(SETUP)
    k.run(OWN_CELL_BEFORE)
    before = _status(k, "cell_run")
    assert before["status"] == "failed" and "DeviceMismatch" in before["error"], before
    assert "met a CPU tensor of shape (256, 4)" in before["error"]
    now = _cell("00_your_own_code", "%%gpu_lab --ranks")
    assert "x = torch.randn(256, 4)\n" not in now
    k.run(now)
    assert _status(k, "cell_run") == {"status": "succeeded", "error": "None"}


def test_the_out_of_memory_example_keeps_its_batch_on_the_models_device(kernels):
    k = kernels(SETUP)
    for source, want in ((OOM_STEP_BEFORE, "failed"),
                         (_definitions(_cell("08_troubleshooting", "def train_step(")), "succeeded")):
        k.run(source)
        # the fixed step of the notebook: a batch of 256 in 4 pieces of 64 fits the cap
        k.run("run = gpu_lab.launch(train_step, 256, 4, num_processes=tutorial.ranks())")
        got = _status(k, "run")
        assert got["status"] == want, got
        if want == "failed":
            assert "DeviceMismatch" in got["error"] and "met a CPU tensor" in got["error"], got
