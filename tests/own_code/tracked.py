"""A script that gpu_lab does not launch (accelerate launch, torchrun, python) and that names
gpu_lab's tracker: its run is recorded all the same. `python tracked.py end|exit|fail`."""
import sys

from accelerate import Accelerator

import gpu_lab

acc = Accelerator(log_with=gpu_lab.Tracker())
acc.init_trackers("tracked", config={"lr": 0.1, "mode": sys.argv[1]})
for step in range(5):
    acc.log({"loss": 1.0 / (step + 1)}, step=step)
if sys.argv[1] == "fail":
    raise ValueError("the data ran out")
if sys.argv[1] == "end":
    acc.end_training()
