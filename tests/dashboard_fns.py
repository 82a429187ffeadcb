"""Small training functions for the dashboard tests (importable from a kernel, too).

`train_tiny(config)` has the signature of gpu_lab.train.train_classifier: it reads max_steps,
batch_size and lr from a TrainConfig and reports loss, lr, samples_per_s, data_wait and step_time every step,
so the LivePlot's panels all fill. It trains a linear model: seconds, not minutes, on 2 CPU ranks.
"""
from __future__ import annotations

import time

import gpu_lab


def train_tiny(config, sleep: float = 0.0):
    import torch

    acc = gpu_lab.accelerator()
    torch.manual_seed(config.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(config.seed + acc.process_index)
    steps = config.max_steps or 20
    for step in range(steps):
        t0 = time.perf_counter()
        x = torch.randn(config.batch_size, 16, generator=g)
        y = torch.randint(0, 4, (config.batch_size,), generator=g)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        # the names and meanings gpu_lab's fit loop reports: global samples/s, seconds per step
        gpu_lab.report(step, loss=loss.detach(), lr=config.lr,
                       samples_per_s=config.batch_size * acc.num_processes / max(t2 - t0, 1e-9),
                       data_wait=t1 - t0, step_time=t2 - t0)
        if sleep:
            time.sleep(sleep)
    print(f"rank {acc.process_index}: done after {steps} steps", flush=True)
    return {"steps": steps, "final_loss": loss.item()}
