"""A trained model back from its checkpoint: the best evaluated one a run kept, loaded into the
config's model or the user's own, predicting on tensors and on image files."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpu_lab.config import TrainConfig
from gpu_lab.train.checkpoint import CheckpointError
from gpu_lab.train.inference import best_checkpoint, load_model, predict

pytestmark = pytest.mark.slow  # trains a tiny model in this process (a few seconds)


class _Record:
    """What best_checkpoint reads of a Run: its output folder and rank 0's evaluations (the
    record itself is tested where runs write it; here, the choice)."""

    def __init__(self, output_dir: str, evals: dict[int, float], **others: dict) -> None:
        self.output_dir, self.id = output_dir, "r"
        self.metrics = self
        self._evals = {"accuracy": evals, **others}

    def series(self, name: str, rank: int = 0):
        got = self._evals.get(name, {})
        return list(got), list(got.values())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from gpu_lab.train import train_classifier

    out = tmp_path_factory.mktemp("predict")
    cfg = TrainConfig(model="tiny_cnn", image_size=32, num_classes=4, batch_size=32, max_steps=30,
                      lr=3e-3, eval_every=10, checkpoint_every=10, keep_last=2, augment="none",
                      num_workers=0, tensorboard=False, output_dir=str(out))
    summary = train_classifier(cfg)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return cfg, summary


def test_the_best_kept_evaluated_checkpoint_is_chosen(trained):
    cfg, _ = trained
    # step 10's checkpoint was pruned (keep_last=2): its better value cannot be chosen
    best = best_checkpoint(_Record(cfg.output_dir, {10: 0.99, 20: 0.8, 30: 0.7}))
    assert (best.step, best.value, best.metric) == (20, 0.8, "accuracy")
    assert best_checkpoint(_Record(cfg.output_dir, {20: 0.6, 30: 0.9})).step == 30
    losses = _Record(cfg.output_dir, {}, eval_loss={20: 0.4, 30: 0.5})
    assert best_checkpoint(losses, metric="eval_loss").step == 20  # lower is better for a loss
    assert best_checkpoint(losses, metric="eval_loss", higher=True).step == 30


def test_a_run_without_an_evaluated_checkpoint_is_refused_naming_the_setting(trained):
    cfg, _ = trained
    with pytest.raises(CheckpointError, match="eval_every to a multiple of checkpoint_every"):
        best_checkpoint(_Record(cfg.output_dir, {15: 0.9}))
    with pytest.raises(TypeError, match="accepted: a Run"):
        best_checkpoint(cfg.output_dir)  # a folder has no record of its evaluations
    with pytest.raises(CheckpointError, match="no checkpoint"):
        best_checkpoint(_Record(str(Path(cfg.output_dir) / "nothing"), {}))


def test_load_model_predicts_what_the_run_learned(trained, tmp_path):
    import torch

    from gpu_lab.data import make_synthetic_images
    from gpu_lab.data.synthetic import SyntheticImages
    from gpu_lab.data.transforms import build_transform

    cfg, summary = trained
    model = load_model(cfg.output_dir)  # the newest checkpoint, the config's model
    held_out = SyntheticImages(64, 32, 4, seed=cfg.seed + 1, transform=build_transform(
        False, 32, "none"))
    x = torch.stack([held_out[i][0] for i in range(64)])
    y = [held_out[i][1] for i in range(64)]
    labels, probs = predict(model, x)
    right = sum(a == b for a, b in zip(labels, y)) / len(y)
    assert right > 0.5 and all(0.25 <= p <= 1 for p in probs), (right, summary["accuracy"])
    # files, as a user has them: decoded and resized as the evaluation saw them
    files = make_synthetic_images(tmp_path / "imgs", 8, image_size=48, num_classes=4, seed=1)
    paths = sorted(files.root.rglob("*.jpg"))
    labels, _ = predict(model, paths, image_size=32)
    assert len(labels) == 8 and set(labels) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="image_size"):
        predict(model, paths)


def test_the_wrong_module_is_refused_naming_it(trained):
    from torch import nn

    cfg, _ = trained
    with pytest.raises(CheckpointError, match="do not fit Linear"):
        load_model(cfg.output_dir, nn.Linear(3, 4))
