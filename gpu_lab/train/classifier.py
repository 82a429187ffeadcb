"""train_classifier(config): the standard training function that LaunchPanel and the tutorials
launch. Module-level (so it pickles by reference into forked or spawned workers) and a function of
the config alone, so `gpu_lab.launch(train_classifier, cfg)`, notebook_launcher and torchrun all run
it the same way.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from ..config import TrainConfig
from .validate import as_config, validate

# Synthetic data set sizes (images are rendered on the fly, so size costs time, not memory).
SYNTHETIC_TRAIN, SYNTHETIC_EVAL = 2048, 512
QUICK_TRAIN, QUICK_EVAL = 512, 128  # quick mode: tutorials and tests on a CPU


def synthetic_sizes() -> tuple[int, int]:
    """(train, eval) synthetic images: fewer in quick mode (gpu_lab.quickmode)."""
    from ..quickmode import quick

    return (QUICK_TRAIN, QUICK_EVAL) if quick() else (SYNTHETIC_TRAIN, SYNTHETIC_EVAL)


def datasets(config: TrainConfig):
    """(train, eval) data for `config`: synthetic images when data_dir is empty; WebDataset shards
    (gpu_lab.data.shard_loader) when data_dir, or its train/ folder, holds shards; else an
    ImageFolder tree (data_dir/train and data_dir/val if present, else a fixed 90/10 split)."""
    from ..data.transforms import build_transform

    if config.data_dir is not None:
        root = Path(config.data_dir).expanduser()
        train_dir = root / "train" if _has_shards(root / "train") else root
        if _has_shards(train_dir):
            return _shard_loaders(train_dir, root / "val", config)

    train_tf = build_transform(True, config.image_size, config.augment)
    eval_tf = build_transform(False, config.image_size, "none")
    if config.data_dir is None:
        from ..data.synthetic import SyntheticImages

        n_train, n_eval = synthetic_sizes()
        # different seeds: the eval images are never the training images
        return (SyntheticImages(n_train, config.image_size, config.num_classes, seed=config.seed,
                                transform=train_tf),
                SyntheticImages(n_eval, config.image_size, config.num_classes, seed=config.seed + 1,
                                transform=eval_tf))
    return _image_folder(Path(config.data_dir).expanduser(), config, train_tf, eval_tf)


def _has_shards(d: Path) -> bool:
    return d.is_dir() and any(True for pat in ("*.tar", "*.tar.zst", "*.tgz", "*.tar.gz")
                              for _ in d.glob(pat))


def _shard_loaders(train_dir: Path, val_dir: Path, config: TrainConfig):
    """This rank's shard loaders. Training shards are resampled with several ranks (drawn with
    replacement, an equal number of batches per rank): without it, ranks whose shards hold fewer
    samples run out first and DDP hangs in the next all-reduce. Evaluation shards never are: each
    rank reads its own share of the shards (or of the samples, when there are fewer shards than
    readers) exactly once, and fit sums the ranks' counts at the end."""
    from ..data import shard_loader

    world = int(os.environ.get("WORLD_SIZE", "1"))
    kw = dict(image_size=config.image_size, num_workers=config.num_workers, seed=config.seed,
              decode=config.decode)
    train = shard_loader(str(train_dir), config.batch_size, train=True, augment=config.augment,
                         resampled=world > 1, **kw)
    evaluation = (shard_loader(str(val_dir), config.batch_size, train=False, **kw)
                  if _has_shards(val_dir) else None)
    return train, evaluation


def _image_folder(root: Path, config: TrainConfig, train_tf, eval_tf):
    import torch
    from torch.utils.data import Subset
    from torchvision.datasets import ImageFolder

    if (root / "train").is_dir():
        val = root / "val" if (root / "val").is_dir() else None
        train = ImageFolder(str(root / "train"), transform=train_tf)
        return train, (ImageFolder(str(val), transform=eval_tf) if val else None)
    full_train = ImageFolder(str(root), transform=train_tf)
    full_eval = ImageFolder(str(root), transform=eval_tf)
    if len(full_train.classes) != config.num_classes:
        raise ValueError(f"TrainConfig.num_classes: got {config.num_classes}, but {root} has "
                         f"{len(full_train.classes)} class folders")
    order = torch.randperm(len(full_train), generator=torch.Generator().manual_seed(config.seed)).tolist()
    n_eval = max(1, len(order) // 10)
    return Subset(full_train, order[n_eval:]), Subset(full_eval, order[:n_eval])


def train_classifier(config: TrainConfig | Mapping[str, Any] | None = None, **overrides: Any) -> dict:
    """Build `config.model`, its data (synthetic when data_dir is empty) and fit it; returns fit's
    summary. Call it on every rank (a launcher does)."""
    from accelerate.utils import set_seed

    from ..models import build
    from .loop import fit

    cfg = validate(as_config(config, **overrides))
    set_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build(cfg.model, cfg.num_classes, cfg.image_size)
    train, evaluation = datasets(cfg)
    return fit(model, train, cfg, eval_data=evaluation)


__all__ = ["train_classifier", "datasets", "synthetic_sizes"]
