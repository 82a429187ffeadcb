"""A trained model back from its checkpoint, and what it predicts.

    best = best_checkpoint(run)                  # the kept checkpoint whose evaluation was best
    model = load_model(best)                     # the config's model (or yours: model=MyNet())
    labels, probs = predict(model, ["cat.jpg"], image_size=32)

"Best" is read from the run's record: the evaluation fit reported at the very step a checkpoint
was written (eval_every a multiple of checkpoint_every makes each checkpoint evaluated). Only
checkpoints still on disk count (keep_last prunes the oldest): the answer says which step and
value it chose, and a run with no evaluated checkpoint is refused naming what to set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .checkpoint import CheckpointError, CheckpointInfo, checkpoint_file, list_checkpoints, load_json


@dataclass(frozen=True)
class Best(CheckpointInfo):
    """A checkpoint, with the evaluation it was chosen by."""

    metric: str = ""
    value: float = float("nan")


def _output_dir(run_or_dir: Any) -> Path:
    out = getattr(run_or_dir, "output_dir", run_or_dir)
    if out is None:
        raise ValueError(f"{run_or_dir!r} has no output folder: pass a run that trained with a "
                         "TrainConfig (launch(train_classifier, cfg), fit) or its output_dir")
    return Path(os.fspath(out)).expanduser()


def best_checkpoint(run: Any, metric: str = "accuracy", higher: bool | None = None) -> Best:
    """The run's kept checkpoint whose evaluation at its own step was best by `metric` (rank 0's
    value; higher is better for accuracy, lower for a loss unless `higher` says otherwise).
    `run`: a Run (gpu_lab.launch, gpu_lab.attach)."""
    from .checkpoint import checkpoint_dir

    if not hasattr(getattr(run, "metrics", None), "series"):
        raise TypeError(f"best_checkpoint: got {type(run).__name__}; accepted: a Run "
                        "(gpu_lab.launch, gpu_lab.attach): its record says which checkpoint was "
                        "evaluated best. For a folder, load_model(folder) takes the newest")
    higher = (not metric.endswith("loss")) if higher is None else higher
    kept = list_checkpoints(checkpoint_dir(_output_dir(run)))
    if not kept:
        raise CheckpointError(f"run {getattr(run, 'id', run)}: no checkpoint in "
                              f"{checkpoint_dir(_output_dir(run))}")
    steps, values = run.metrics.series(metric, rank=0)
    at = dict(zip((int(s) for s in steps), values))
    scored = [(at[c.step], c) for c in kept if c.step in at]
    if not scored:
        raise CheckpointError(
            f"run {getattr(run, 'id', run)}: none of its kept checkpoints (steps "
            f"{[c.step for c in kept]}) was evaluated for {metric!r} at its own step; set "
            "eval_every to a multiple of checkpoint_every (or use load_model(run) for the last)")
    value, info = (max if higher else min)(scored, key=lambda vc: vc[0])
    return Best(path=info.path, step=info.step, manifest=info.manifest, metric=metric,
                value=value)


def load_model(source: Any, model: Any = None) -> Any:
    """The model of a checkpoint, in eval mode on the CPU. `source`: a checkpoint (CheckpointInfo
    or its folder), or a run or output folder (its newest checkpoint). `model`: your nn.Module,
    whose weights are replaced; None builds the checkpoint's config's model (gpu_lab.models)."""
    from safetensors.torch import load_model as load_into

    path = _checkpoint_path(source)
    if model is None:
        from ..config import TrainConfig
        from ..models import build

        state = load_json(path, "trainer_state.json")
        cfg = TrainConfig.from_dict(state["config"])
        model = build(cfg.model, cfg.num_classes, cfg.image_size)
    weights = checkpoint_file(path, "model.safetensors")  # only a file its manifest lists
    try:
        load_into(model, str(weights))
    except RuntimeError as e:  # the shapes or names do not match
        raise CheckpointError(f"{path}: its weights do not fit {type(model).__name__}: "
                              f"{str(e).strip().splitlines()[0]}; pass the module it was trained "
                              "as") from None
    return model.eval()


def _checkpoint_path(source: Any) -> Path:
    from .checkpoint import checkpoint_dir, latest_checkpoint

    if isinstance(source, CheckpointInfo):
        return source.path
    p = _output_dir(source)
    if (p / "model.safetensors").is_file():
        return p
    info = latest_checkpoint(checkpoint_dir(p)) or latest_checkpoint(p)
    if info is None:
        raise CheckpointError(f"no complete checkpoint under {p}")
    return info.path


def predict(model: Any, images: Sequence[Any] | Any, image_size: int | None = None,
            batch_size: int = 64) -> tuple[list[int], list[float]]:
    """Each image's predicted class index and its probability. `images`: a batch tensor
    (N, C, H, W) already transformed, or image files / PIL images, decoded and resized to
    `image_size` as the evaluation saw them."""
    import torch

    if not isinstance(images, torch.Tensor):
        images = _load_images(images, image_size)
    labels: list[int] = []
    probs: list[float] = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            p = torch.softmax(model(images[i:i + batch_size]).float(), dim=1)
            top = p.max(dim=1)
            labels += top.indices.tolist()
            probs += top.values.tolist()
    return labels, probs


def _load_images(images: Iterable[Any], image_size: int | None) -> Any:
    import torch
    from PIL import Image

    from ..data.transforms import build_transform

    if image_size is None:
        raise ValueError("predict: image files need image_size= (the size the model trained at)")
    tf = build_transform(False, image_size, "none")
    out = []
    for im in images:
        if not isinstance(im, Image.Image):
            with Image.open(im) as f:
                im = f.convert("RGB")
        out.append(tf(im.convert("RGB")))
    return torch.stack(out)
