"""GPU training throughput: ResNet-50 img/s in fp32, TF32 and bf16, with channels_last and
torch.compile, MFU, printed next to NVIDIA's published A100 80GB figures (DeepLearningExamples
resnet50v1.5: 938 img/s TF32, 2,470 img/s AMP per GPU).

    .venv/bin/python bench/gpu_train.py                 # every variant on GPU 0
    .venv/bin/python bench/gpu_train.py --no-compile    # skip the torch.compile variants (minutes)
    .venv/bin/python bench/gpu_train.py --cpu           # tiny-model CPU mode (what CI runs)

Without a GPU it runs the CPU mode. Same options as `gpu-lab bench gpu` (this script calls it).
"""
from __future__ import annotations

import sys

from gpu_lab.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "gpu", *sys.argv[1:]]))
