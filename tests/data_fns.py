"""Code the data tests run in other processes: a rank reading shards (as a script) and a DDP
training function launched on 2 gloo ranks through gpu_lab.launch."""
from __future__ import annotations

import json
import sys


def read_keys(shard_dir: str, out: str, epochs: int = 2, num_workers: int = 2,
              batch_size: int = 7) -> None:
    """One rank (RANK/WORLD_SIZE from the environment): the keys it sees in each epoch."""
    from gpu_lab.data import shard_loader

    loader = shard_loader(shard_dir, batch_size, train=True, image_size=16, num_workers=num_workers,
                          return_keys=True, pin_memory=False)
    result = {"rank": loader.rank, "world_size": loader.world_size, "epochs": []}
    for _ in range(epochs):
        expected_batches = len(loader)  # this epoch's count, from the manifest
        keys, batches = [], 0
        for images, labels, k in loader:
            assert images.shape[1:] == (3, 16, 16) and len(labels) == len(k)
            keys += k
            batches += 1
        result["epochs"].append({"keys": keys, "batches": batches, "len": expected_batches})
    with open(out, "w") as f:
        json.dump(result, f)


def train_on_shards(shard_dir: str, batch_size: int = 8, epochs: int = 2):
    """DDP training on shards with resampled=True: every rank must run the same number of steps
    (each step all-reduces gradients: a rank that stopped early would hang the other)."""
    import torch

    import gpu_lab
    from gpu_lab.data import shard_loader

    # This rank is forked from the pytest process, which has already run multi-threaded (OpenMP)
    # torch ops in other tests; a forked child's first parallel region then hangs in libgomp.
    # One intra-op thread per rank avoids that (2 gloo ranks on 2 cores need no more).
    torch.set_num_threads(1)
    acc = gpu_lab.accelerator()
    loader = shard_loader(shard_dir, batch_size, train=True, image_size=16, num_workers=1,
                          resampled=True, pin_memory=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    steps = 0
    for _ in range(epochs):
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            steps += 1
            gpu_lab.report(steps, loss=loss.detach())
    every = acc.gather(torch.tensor([[acc.process_index, steps, len(loader), loader.rank,
                                      loader.world_size]]))
    return {"ranks": every.tolist()}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "read_keys":
        read_keys(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
