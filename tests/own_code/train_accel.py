"""A training script written the way accelerate's examples are: argparse, a bare Accelerator,
init_trackers, accelerator.log and save_state. It never imports gpu_lab: the tests launch it as a
user would, by its path or as a module (-m own_code.train_accel)."""
import argparse
import atexit
import json
import os
import sys
import time

import torch
from accelerate import Accelerator


def parse_args():
    p = argparse.ArgumentParser(description="a tiny regression, trained the accelerate way")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True, help="where each rank leaves what it saw")
    p.add_argument("--pace", type=float, default=0.0, help="seconds a step takes at least")
    p.add_argument("--log-with", default="all")
    p.add_argument("--tag", default="", help="a label kept in the config")
    p.add_argument("--stamp", default=None, help="write time.time() here after the first step")
    return p.parse_args()


def main():
    args = parse_args()
    acc = Accelerator(log_with=args.log_with, project_dir=args.out)
    acc.init_trackers("own_code", config=vars(args))
    seen = {"num_processes": acc.num_processes, "process_index": acc.process_index,
            "distributed_type": str(acc.distributed_type).split(".")[-1],
            "argv": sys.argv[1:], "name": __name__, "pid": os.getpid(),
            "interactive": hasattr(sys, "ps1")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(seen, f)
    atexit.register(lambda: open(os.path.join(args.out, f"atexit{acc.process_index}"), "w").close())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    for step in range(args.steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 0 and args.stamp and acc.is_main_process:
            with open(args.stamp, "w") as f:  # a benchmark's clock (bench/script_first_step.py)
                f.write(repr(time.time()))
        acc.log({"loss": loss.item(), "lr": args.lr}, step=step)
        if args.pace:
            time.sleep(args.pace)  # a step's pace: a run long enough to be stopped
    acc.save_state(os.path.join(args.out, "state"))
    acc.end_training()


if __name__ == "__main__":
    main()
