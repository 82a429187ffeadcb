"""Training functions the launch tests run on 2 gloo ranks (importable from a kernel too)."""
from __future__ import annotations

import os
import tempfile
import time

import gpu_lab


def train_linear(steps: int = 10, sleep: float = 0.0):
    """A tiny DDP run: returns distributed facts and every rank's parameters (gathered)."""
    import torch

    acc = gpu_lab.accelerator()
    torch.manual_seed(1234 + acc.process_index)  # different init per rank: DDP must sync it
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(acc.process_index)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        gpu_lab.report(step, loss=loss.detach(), bad_fork=float(torch._C._cuda_isInBadFork()))
        if sleep:
            time.sleep(sleep)
    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    every = acc.gather(flat.unsqueeze(0))
    state = acc.state
    return {"distributed_type": str(state.distributed_type.value),
            "num_processes": state.num_processes, "params": every.tolist(),
            "pid": os.getpid(), "tempdir": tempfile.gettempdir()}


def train_forever(report_every: float = 0.05):
    """Trains until stopped."""
    import torch

    acc = gpu_lab.accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    step = 0
    while True:
        loss = model(torch.randn(4, 4)).pow(2).mean()
        acc.backward(loss)
        gpu_lab.report(step, loss=loss.detach())
        step += 1
        time.sleep(report_every)


def rank1_raises(steps_before: int = 3):
    import torch

    acc = gpu_lab.accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    for step in range(100):
        if acc.process_index == 1 and step == steps_before:
            raise ValueError("rank one broke on purpose at step 3")
        loss = model(torch.randn(4, 4)).pow(2).mean()
        acc.backward(loss)  # all-reduce: rank 0 then waits for rank 1 forever
        gpu_lab.report(step, loss=loss.detach())
    return "unreachable"


def rank1_sigkilled():
    import signal

    import torch

    acc = gpu_lab.accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    for step in range(1000):
        if acc.process_index == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.randn(4, 4)).pow(2).mean()
        acc.backward(loss)
        gpu_lab.report(step, loss=loss.detach())
        time.sleep(0.01)


def preempted_at_step(k: int = 2):
    """What the preemption guard does: checkpoint, then exit 143 on every rank."""
    import torch

    acc = gpu_lab.accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    for step in range(100):
        if step == k:
            raise SystemExit(143)
        acc.backward(model(torch.randn(4, 4)).pow(2).mean())
        gpu_lab.report(step, loss=1.0)


def fit_params(config, pace: float = 0.0):
    """fit() on synthetic images (the config's model) with a pause after every step, so a test can
    act on the run mid-way; returns fit's summary and rank 0's final parameters."""
    from accelerate.utils import set_seed

    from gpu_lab.models import build
    from gpu_lab.train import Callback, fit
    from gpu_lab.train.classifier import datasets

    class Pace(Callback):
        def on_step_end(self, state):
            time.sleep(pace)

    set_seed(config.seed)
    model = build(config.model, config.num_classes, config.image_size)
    train, _ = datasets(config)
    summary = fit(model, train, config, callbacks=[Pace()] if pace else [])
    summary["params"] = [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
    return summary


def returns_unpicklable():
    """Rank 0 returns what pickle refuses (a lambda)."""
    gpu_lab.report(0, loss=1.0)
    return lambda: "not on disk"


def collects_garbage():
    """gc.collect() in the run: what it may finalize of the kernel's objects."""
    import gc

    return gc.collect()


def bare_accelerator():
    """What every accelerate script does: a bare Accelerator(), no gpu_lab call in sight."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(3, 1))
    world = dist.get_world_size() if dist.is_initialized() else 1
    acc.log({"loss": 1.0 / (1 + acc.process_index)}, step=acc.process_index)
    return {"distributed_type": str(acc.distributed_type).split(".")[-1],
            "num_processes": acc.num_processes, "world": world,
            "weight": [float(w) for w in acc.unwrap_model(model).weight.detach().flatten()]}


def accelerator_without_cpu_switch():
    """Code that takes away the switch gpu_lab set: its accelerate state is a single process."""
    import os

    from accelerate import Accelerator

    os.environ.pop("ACCELERATE_USE_CPU", None)
    Accelerator()


def spawns_its_own_ranks(how: str = "spawn"):
    import torch.multiprocessing as mp

    if how == "spawn":
        mp.spawn(print, nprocs=2)
    else:
        mp.start_processes(print, nprocs=2, start_method="fork")
