"""Training functions for the export, headless-entry and multi-node tests: tiny, CPU-only, a few seconds.

They are addressed as `export_fns:<name>` (tests/ is put on PYTHONPATH), the way a user addresses
their own `module:function` in an exported command.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import gpu_lab


def _steps(config, default: int) -> int:
    return int(getattr(config, "max_steps", None) or default)


def train_tiny(config=None):
    """DDP on a linear model; reports loss and lr per step; returns the distributed facts."""
    import torch

    acc = gpu_lab.accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    lr = float(getattr(config, "lr", 0.05))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(acc.process_index)
    pace = float(os.environ.get("TINY_STEP_SLEEP", "0"))  # a slower step, where a test needs one
    for step in range(_steps(config, 6)):
        if pace:
            time.sleep(pace)
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        gpu_lab.report(step, loss=loss.detach(), lr=lr)
    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    every = acc.gather(flat.unsqueeze(0))
    return {"world_size": acc.num_processes, "rank": acc.process_index,
            "distributed_type": str(acc.state.distributed_type.value),
            "params": every.tolist(), "node_rank": int(os.environ.get("GROUP_RANK", "0"))}


def rank1_fails_rank0_waits(config=None):
    """No torch: rank 1 raises at once; rank 0 waits until torchrun's shutdown (SIGTERM) ends it."""
    gpu_lab.report(0, loss=1.0)
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one broke on purpose")
    threading.Event().wait(120)  # blocks; torchrun's SIGTERM ends the process long before
    return "unreachable"


def train_until_preempted(config=None):
    """The real training toolkit's fit() on a tiny data set, long enough to be preempted: its
    PreemptionGuard turns SIGUSR1 (Slurm's --signal) into checkpoint + exit 143. Every rank
    writes its pid to $GPU_LAB_RUN_DIR/pids/ once training runs, so a test can signal it."""
    import torch
    from torch.utils.data import TensorDataset

    from gpu_lab.train import Callback, fit

    class AnnouncePid(Callback):
        def on_step_end(self, state) -> None:
            if state.step == 2:
                d = os.path.join(os.environ["GPU_LAB_RUN_DIR"], "pids")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"rank{state.rank}.pid"), "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(0.02)  # keep the run alive until the test's signal arrives

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    return fit(torch.nn.Linear(8, 2), data, config, callbacks=[AnnouncePid()])


def sigterm_self(config=None, sig=signal.SIGTERM):
    """A plain function (no fit, no guard) that gets SIGTERM: the headless entry records 'stopped'."""
    gpu_lab.report(0, loss=1.0)
    os.kill(os.getpid(), sig)
    time.sleep(30)
    return "unreachable"


def sigusr1_self(config=None):
    return sigterm_self(config, signal.SIGUSR1)


not_callable = 42


def raises(config=None):
    gpu_lab.report(0, loss=2.0)
    raise ValueError("broke on purpose")


def report_only(config=None):
    """No torch: a quick function for the single-process headless-entry tests."""
    for step in range(int(getattr(config, "max_steps", None) or 3)):
        gpu_lab.report(step, loss=1.0 / (step + 1))
    return "done"


def sighup_self(config=None):
    return sigterm_self(config, signal.SIGHUP)


def returns_unpicklable(config=None):
    """A training function whose return value cannot be pickled (a lambda)."""
    gpu_lab.report(0, loss=1.0)
    return lambda: "not on disk"


def train_where(config=None):
    """train_tiny, and the network namespace it ran in: another host's, in a namespace test."""
    return dict(train_tiny(config), netns=os.readlink("/proc/self/ns/net"))
