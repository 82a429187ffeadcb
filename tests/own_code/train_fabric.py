"""A Fabric loop: fabric.log each step and fabric.save at the end. It never imports gpu_lab."""
import argparse
import time

import lightning as L
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pace", type=float, default=0.0)
    a = p.parse_args()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(a.steps):
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        fabric.log("loss", loss.item(), step=step)
        time.sleep(a.pace)
    fabric.save(f"{a.out}/final.ckpt", {"model": model, "optimizer": opt, "step": a.steps})


if __name__ == "__main__":
    main()
