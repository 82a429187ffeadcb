"""Resuming on purpose: which checkpoint a resume names, and whether this config may continue it.

A checkpoint written by fit() keeps the config it was trained with (trainer_state.json). A run may
continue it only if the fields that shape the saved state are the same:

- must match (MUST_MATCH): model, num_classes, image_size, optimizer, sharding. Another value would
  load weights or optimizer state into a model or optimizer they were not made for.
- may change (everything else), for example: max_steps and epochs (the schedule is stretched over
  the new length from the saved step), lr, warmup_ratio, scheduler, batch_size and
  grad_accum_steps (the data position is rescaled), mixed_precision, num_workers, checkpoint_every,
  keep_last, eval_every, log_every, data_dir, seed.

Nothing here imports torch: the launcher checks a resume before any rank starts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from .checkpoint import (CHECKPOINTS, MANIFEST, CheckpointError, CheckpointInfo, latest_checkpoint,
                         read_manifest, verify)

MUST_MATCH = ("model", "num_classes", "image_size", "optimizer", "sharding")
STATE_FILE = "trainer_state.json"


class ResumeMismatchError(ValueError):
    """The checkpoint was trained with other values of fields that must match to continue."""

    def __init__(self, path: str | os.PathLike, diffs: dict[str, tuple[Any, Any]]) -> None:
        self.path = str(path)
        self.diffs = diffs
        lines = "; ".join(f"{k}: checkpoint {a!r}, this config {b!r}" for k, (a, b) in diffs.items())
        super().__init__(
            f"cannot resume from {path}: it was trained with other values of "
            f"{', '.join(diffs)} ({lines}). These fields must match to continue a run; launch "
            f"without resume to start afresh, or use a config with the checkpoint's values.")


def fingerprint(config: Any) -> dict[str, Any]:
    """The fields of a config (TrainConfig or dict) that must match to continue its checkpoints."""
    d = config if isinstance(config, Mapping) else config.to_dict()
    out = {k: d.get(k) for k in MUST_MATCH}
    if out["sharding"] is None:  # a checkpoint from before sharding=: its zero said it
        out["sharding"] = "zero1" if d.get("zero") else "none"
    return out


def saved_config(info: CheckpointInfo) -> dict | None:
    """The config a checkpoint was trained with, or None (a checkpoint not written by fit)."""
    p = Path(info.path) / STATE_FILE
    if STATE_FILE not in (info.manifest or {}).get("files", {}) or not p.is_file():
        return None
    try:
        cfg = json.loads(p.read_text()).get("config")
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def check_compatible(info: CheckpointInfo, config: Any) -> None:
    """Raise ResumeMismatchError naming each field (and both values) that differs."""
    saved = saved_config(info)
    if saved is None or config is None:
        return
    mine = fingerprint(config)
    diffs = {k: (saved.get(k), mine[k]) for k in MUST_MATCH
             if k in saved and saved.get(k) != mine[k]}
    if diffs:
        raise ResumeMismatchError(info.path, diffs)


def find_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """A checkpoint from a path: a checkpoint folder itself (step_N), or an output folder (or its
    checkpoints/ folder), whose newest complete checkpoint is taken."""
    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        manifest = verify(p)
        return CheckpointInfo(path=p, step=int(manifest["step"]), manifest=manifest)
    for root in (p / CHECKPOINTS, p):
        info = latest_checkpoint(root)
        if info is not None:
            return info
    if not p.exists():
        raise CheckpointError(f"resume: {p} does not exist; accepted: a run, a run id, a "
                              "checkpoint folder (step_N) or an output folder holding checkpoints")
    raise CheckpointError(f"resume: no complete checkpoint in {p} (looked for step_N folders with "
                          f"a {MANIFEST} in it and in {p / CHECKPOINTS})")


def read_step(info: CheckpointInfo) -> int:
    manifest = info.manifest or read_manifest(info.path)
    return int(manifest.get("step", info.step))


__all__ = ["MUST_MATCH", "ResumeMismatchError", "fingerprint", "check_compatible",
           "find_checkpoint", "saved_config"]
