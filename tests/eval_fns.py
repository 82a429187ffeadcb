"""Code the exact-evaluation tests run in rank processes (and, for one rank, in the test process).

Every evaluation image carries its sample id: a flat colour whose red and green values are the id
(PNG, so exact through shards, ImageFolder and the eval transform). `IdProbe`, the model under
test, reads the ids of every image it evaluates and predicts the right class exactly for the ids
divisible by 3, so a metric over the whole set is known in advance. The synthetic data set has no
ids in its pixels; there the probe looks each image up in a table of the set's images.

    python tests/eval_fns.py matrix <data_root> <out_dir> <nproc>   # every case, nproc gloo ranks
    python tests/eval_fns.py digits <out_dir>                       # scikit-learn's digits, 2 ranks

`matrix` writes <out_dir>/rank<r>.json: {case: [one entry per evaluation: ids seen, metrics]}.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

N_VAL = 23          # 5 shards of 5, 5, 5, 5, 3; 2 shards of 12, 11; partial last batch of 3
N_TRAIN = 24
BATCH = 4
CLASSES = 4
SIZE = 8            # images are written at the model's size: the eval transform leaves them as they are
SHARD_COUNTS = (1, 2, 5)
TINY = 3            # fewer samples than one batch: rank 1 of 2 evaluates nothing at all


def label_of(i: int) -> int:
    return i % CLASSES


def write_id_images(root: Path, ids) -> None:
    """An ImageFolder tree root/<label>/<id>.png of flat colours (red, green) = id."""
    from PIL import Image

    for i in ids:
        d = root / str(label_of(i))
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (SIZE, SIZE), (i % 256, i // 256, 128)).save(d / f"{i:05d}.png")


def make_data(root: Path) -> None:
    """ImageFolder trees and shard sets (1, 2 and 5 validation shards) of id images."""
    from gpu_lab.data import write_shards

    folder = root / "folder"
    write_id_images(folder / "train", range(1000, 1000 + N_TRAIN))
    write_id_images(folder / "val", range(N_VAL))
    write_shards(folder / "train", root / "train_shards", maxcount=6, progress=False)
    for k in SHARD_COUNTS:
        report = write_shards(folder / "val", root / f"shards{k}" / "val",
                              maxcount=math.ceil(N_VAL / k), progress=False)
        assert len(report.manifest.shards) == k
        (root / f"shards{k}" / "train").symlink_to(root / "train_shards", target_is_directory=True)


def id_tensors(ids):
    """Normalised images of the ids, as the eval transform makes them, and their labels."""
    import torch

    from gpu_lab.data.transforms import MEAN, STD

    rgb = torch.tensor([[i % 256, i // 256, 128] for i in ids], dtype=torch.float32) / 255
    x = (rgb - torch.tensor(MEAN)) / torch.tensor(STD)
    return (x[:, :, None, None].expand(-1, -1, SIZE, SIZE).contiguous(),
            torch.tensor([label_of(i) for i in ids]))


def decode_ids(x) -> list[int]:
    import torch

    from gpu_lab.data.transforms import MEAN, STD

    v = (x[:, :2, 0, 0].double() * torch.tensor(STD[:2], dtype=torch.float64)
         + torch.tensor(MEAN[:2], dtype=torch.float64)) * 255
    v = v.round().long()
    return (v[:, 0] + 256 * v[:, 1]).tolist()


class Lookup:
    """Ids of images without ids in their pixels: their index in a data set, found by content."""

    def __init__(self, dataset) -> None:
        self.table = {self.key(dataset[i][0]): i for i in range(len(dataset))}
        self.labels = [int(dataset[i][1]) for i in range(len(dataset))]
        assert len(self.table) == len(dataset), "two images of the set look the same"

    @staticmethod
    def key(img) -> tuple:
        return tuple(round(float(v), 3) for v in img.double().flatten()[::7][:24])

    def __call__(self, x) -> list[int]:
        return [self.table[self.key(img)] for img in x]


def probe_class():
    import torch

    class IdProbe(torch.nn.Module):
        """Trains like a linear model; in eval mode records the ids it sees (and the value of its
        buffer, which training sets to the rank) and predicts the true class for ids divisible by 3
        only. A buffer that evaluation does not take from rank 0 shows up as a rank's number."""

        def __init__(self, identify, label=label_of) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, CLASSES)
            self.register_buffer("marker", torch.zeros(()))
            self.identify, self.label = identify, label
            self.seen: list[int] = []
            self.markers: set[float] = set()

        def forward(self, x):
            logits = self.linear(x.mean(dim=(2, 3)))
            if self.training:
                if torch.distributed.is_initialized():
                    self.marker.fill_(float(torch.distributed.get_rank()))
                return logits
            ids = self.identify(x)
            self.seen += ids
            self.markers.add(float(self.marker))
            want = torch.tensor([self.label(i) if i % 3 == 0 else (self.label(i) + 1) % CLASSES
                                 for i in ids], dtype=torch.long)
            return torch.nn.functional.one_hot(want, CLASSES).float() * 20 + 0 * logits

    return IdProbe


def cases(root: Path) -> list[str]:
    names = [f"shards{k}_w{w}" for k in SHARD_COUNTS for w in (0, 2)]
    return names + ["folder_w0", "folder_w2", "synthetic", "dataset", "dataloader_shuffled",
                    "tiny_dataloader"]


def run_case(name: str, root: Path, out: Path) -> list[dict]:
    """fit() on case `name` with the probe; one entry per evaluation it ran."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from gpu_lab.config import TrainConfig
    from gpu_lab.train import Callback, fit
    from gpu_lab.train.classifier import datasets

    workers = 2 if name.endswith("_w2") else 0
    cfg = TrainConfig(model="tiny_cnn", image_size=SIZE, num_classes=CLASSES, batch_size=BATCH,
                      max_steps=1, num_workers=workers, output_dir=str(out / name),
                      tensorboard=False, seed=0, augment="none", resume=False)
    identify, label = decode_ids, label_of
    if name.startswith("shards"):
        cfg = cfg.replace(data_dir=str(root / name.split("_")[0]))
        train, val = datasets(cfg)
    elif name.startswith("folder"):
        cfg = cfg.replace(data_dir=str(root / "folder"))
        train, val = datasets(cfg)
    elif name == "synthetic":
        train, val = datasets(cfg)
        lookup = Lookup(val)
        identify, label = lookup, lookup.labels.__getitem__
    else:
        n = TINY if name == "tiny_dataloader" else N_VAL
        data = TensorDataset(*id_tensors(range(n)))
        train = data
        val = data if name == "dataset" else DataLoader(data, batch_size=BATCH,
                                                         shuffle=name == "dataloader_shuffled")
    probe = probe_class()(identify, label)
    passes: list[dict] = []

    class Snapshot(Callback):
        def on_eval_end(self, state, metrics):
            passes.append({"ids": list(probe.seen), "markers": sorted(probe.markers),
                           "metrics": dict(metrics)})
            probe.seen.clear()
            probe.markers.clear()

    torch.manual_seed(0)
    summary = fit(probe, train, cfg, eval_data=val, callbacks=[Snapshot()], guards=False)
    passes[-1]["summary_eval_samples"] = summary["eval_samples"]
    passes[-1]["summary_accuracy"] = summary["accuracy"]
    return passes


def matrix(root: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    root, out = Path(root), Path(out)
    results = {name: run_case(name, root, out) for name in cases(root)}
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------ real images
def write_digits(root: Path, n_val: int = 297) -> tuple[int, int]:
    """scikit-learn's 1,797 8x8 handwritten digits (shipped with the package) as PNG files in
    ImageFolder trees root/{train,val}/<digit>/, then as shards; (n_train, n_val)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from gpu_lab.data import write_shards

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    splits = {"val": order[:n_val], "train": order[n_val:]}
    for split, idx in splits.items():
        for i in idx:
            d = root / "images" / split / str(digits.target[i])
            d.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)  # 0..16 -> 0..255
            Image.fromarray(pixels).save(d / f"{i:04d}.png")  # 2-D uint8: greyscale
        write_shards(root / "images" / split, root / "shards" / split, maxcount=400,
                     progress=False)
    return len(splits["train"]), n_val


def digits(out: str) -> None:
    """gpu_lab.launch(train_classifier) on the digits shards, 2 gloo ranks, as a user runs it."""
    import gpu_lab
    from gpu_lab.train import train_classifier

    out = Path(out)
    n_train, n_val = write_digits(out / "data")
    cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=8, num_classes=10, batch_size=32,
                              epochs=5, lr=1e-2, warmup_ratio=0.05, augment="none",
                              num_workers=1, num_processes=2, data_dir=str(out / "data" / "shards"),
                              output_dir=str(out / "run"), tensorboard=False, seed=0)
    run = gpu_lab.launch(train_classifier, cfg, name="digits")
    status = run.wait(600)
    result = {"status": status, "run_id": run.id, "n_train": n_train, "n_val": n_val,
              "logs": run.logs(None)[-3000:] + run.logs(0)[-3000:]}
    if status == "succeeded":
        result["summary"] = run.result()
        result["reported_eval_samples"] = run.metrics.last("eval_samples")
    (out / "digits.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # proc_utils.run_or_dump asks for stacks
    cmd, *args = sys.argv[1:]
    if cmd == "matrix":
        from accelerate import notebook_launcher

        from gpu_lab.launch.checks import free_port

        # a free port, not accelerate's fixed default 29500
        notebook_launcher(matrix, args=(args[0], args[1]), num_processes=int(args[2]),
                          use_port=str(free_port()))
    elif cmd == "digits":
        digits(args[0])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
