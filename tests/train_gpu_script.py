"""Run by test_train_gpu.py in its own process (so CUDA is never initialised in pytest's process,
whose later forks would die of it): fp16 + GradScaler through fit(), the scaler's state through a
resume, the real GPU memory probe, and activation checkpointing measured with CUDA's allocator.
Prints one JSON line."""
from __future__ import annotations

import copy
import json
import sys

import torch

from gpu_lab.config import TrainConfig
from gpu_lab.models import build
from gpu_lab.train import fit
from gpu_lab.train import activation
from gpu_lab.train.checkpoint import latest_checkpoint, load_object, checkpoint_dir
from gpu_lab.train.guards import cuda_memory_fraction


def main(out: str) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 3, 32, 32, generator=g),
                                          torch.randint(0, 10, (512,), generator=g))
    cfg = TrainConfig(model="tiny_resnet", image_size=32, num_classes=10, batch_size=64,
                      max_steps=20, mixed_precision="fp16", num_workers=0, output_dir=out,
                      tensorboard=False, checkpoint_every=10)
    torch.manual_seed(0)
    model = build(cfg.model, 10, 32)
    dtypes = []
    model.fc.register_forward_hook(lambda m, i, o: dtypes.append(str(o.dtype)))
    first = fit(model, data, cfg)
    info = latest_checkpoint(checkpoint_dir(out))
    scaler = load_object(info.path, "scaler.pt")
    second = fit(build(cfg.model, 10, 32), data, cfg.replace(max_steps=30))

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    plain = build("resnet18", 10, 64).to(device)
    ckpt = copy.deepcopy(plain)
    activation.enable(ckpt)
    x = torch.randn(32, 3, 64, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    peaks = {}
    for name, m in (("plain", plain), ("checkpointed", ckpt)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated(device) - base
        m.zero_grad(set_to_none=True)
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "first": first, "second": second,
        "head_dtypes": sorted(set(dtypes)), "scaler_state": {k: float(v) for k, v in scaler.items()
                                                            if isinstance(v, (int, float))},
        "memory_fraction": cuda_memory_fraction(device), "resnet18_peak_bytes": peaks,
    }, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
