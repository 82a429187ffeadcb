"""Checkpoints on storage that refuses them, for real: a size-limited tmpfs that the test mounts
and fills (before the write, and during it with both writers: safetensors and torch.save), the
same file system remounted read-only, and a folder whose parent cannot be created. Each time:
CheckpointStorageError names the checkpoint, the folder, the bytes needed and free; the triage
says "storage" with its suggestions in order; earlier checkpoints verify and load; no temp folder
is left behind."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gpu_lab.config import TrainConfig
from gpu_lab.failures import triage
from gpu_lab.units import fmt_bytes
from gpu_lab.models import build
from gpu_lab.train import fit
from gpu_lab.train.checkpoint import (CheckpointStorageError, list_checkpoints, load_object,
                                      load_tensors, save_checkpoint, verify)
from train_helpers import one_thread, tiny_images  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command here: the full-disk tests mount a real tmpfs")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here ({r.stderr.strip()}): the "
                        f"full-disk tests need root or CAP_SYS_ADMIN")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=True)


def _small(p: Path) -> None:
    torch.save({"x": torch.arange(10)}, p)


def _no_leftovers(root: Path) -> None:
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "a temp folder was left"


def _check_triage(exc: BaseException, first: str, *rest: str) -> triage.RankFailure:
    f = triage.from_exception(0, exc)
    assert f.category == triage.STORAGE, f
    for suggestion, start in zip(f.suggestions, (first, *rest)):
        assert suggestion.startswith(start), f.suggestions
    assert "What to try (storage)" in str(triage.RunError([f]))
    return f


def test_full_disk_during_fit_names_what_it_needs_and_keeps_the_earlier_checkpoints(tmpfs):
    disk = tmpfs("1m")  # room for two checkpoints of this model, not three
    c = TrainConfig(model="tiny_cnn", image_size=16, num_classes=4, batch_size=8, max_steps=8,
                    checkpoint_every=1, keep_last=10, num_workers=0, tensorboard=False, seed=3,
                    output_dir=str(disk / "run"))
    torch.manual_seed(3)
    with pytest.raises(CheckpointStorageError) as ei:
        fit(build(c.model, c.num_classes, c.image_size), tiny_images(32), c)
    e = ei.value
    root = disk / "run" / "checkpoints"
    saved = list_checkpoints(root, verify_files=True)
    assert saved and [i.step for i in saved] == list(range(1, len(saved) + 1))
    step = len(saved) + 1
    assert (e.reason, e.checkpoint, e.folder, e.keep_last) == ("space", f"step_{step:09d}",
                                                               str(root), 10)
    assert e.needed_bytes > e.free_bytes
    text = str(e)
    for part in (f"checkpoint step_{step:09d}", f"not enough space in {root}",
                 f"({e.needed_bytes:,} bytes)", f"({e.free_bytes:,} bytes) free", "keep_last=10"):
        assert part in text, text
    # found before the write: the estimate covers what a checkpoint really takes, closely
    assert "after writing" not in text
    on_disk = sum(p.stat().st_size for p in saved[-1].path.iterdir())
    assert on_disk <= e.needed_bytes <= 1.5 * on_disk + 64 * 1024
    for info in saved:  # intact and loadable
        verify(info.path)
        assert load_tensors(info.path) and load_object(info.path, "optimizer.pt")["state"]
    _no_leftovers(root)

    f = _check_triage(e, "free space in", "lower keep_last (now 10)", "point output_dir")
    assert f.details["needed_bytes"] == e.needed_bytes and f.details["free_bytes"] == e.free_bytes
    assert f.details["folder"] == str(root) and f.details["checkpoint"] == e.checkpoint
    assert fmt_bytes(e.needed_bytes) in f.explanation
    # another rank only hears rank 0's verdict, as text: the same triage
    other = triage.categorize("CheckpointError", f"rank 0 failed to save the checkpoint of step "
                                                 f"{step}: CheckpointStorageError: {text}")
    assert other == triage.STORAGE


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_disk_that_fills_up_during_the_write(tmpfs, writer):
    """The estimate said it fits (too small on purpose); the write itself runs out of space."""
    disk = tmpfs("512k")
    root = disk / "checkpoints"
    first = save_checkpoint(root, 1, {"small.pt": _small})
    big = {"w": torch.zeros(200_000)}  # 800 kB on a 512 kB disk
    files = ({"model.safetensors": lambda p: save_file(big, str(p))} if writer == "safetensors"
             else {"optimizer.pt": lambda p: torch.save(big, p)})
    with pytest.raises(CheckpointStorageError) as ei:
        save_checkpoint(root, 2, files, needed_bytes=1000, keep_last=3)
    e = ei.value
    assert e.reason == "space" and e.checkpoint == "step_000000002" and e.folder == str(root)
    cause = "SafetensorError" if writer == "safetensors" else "RuntimeError"
    assert f"not enough space in {root}" in str(e) and f"{cause}: " in str(e)
    assert "after writing" in str(e) and f"({e.free_bytes:,} bytes) free" in str(e)
    assert [i.step for i in list_checkpoints(root, verify_files=True)] == [1]
    verify(first)
    _no_leftovers(root)
    _check_triage(e, "free space in", "lower keep_last (now 3)", "point output_dir")
    assert save_checkpoint(root, 3, {"small.pt": _small}).name == "step_000000003"  # room again


def test_read_only_folder_and_a_parent_that_cannot_be_created(tmpfs):
    disk = tmpfs("1m")
    root = disk / "run" / "checkpoints"
    first = save_checkpoint(root, 1, {"small.pt": _small})
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(CheckpointStorageError) as ei:
        save_checkpoint(root, 2, {"small.pt": _small}, needed_bytes=2000, keep_last=3)
    e = ei.value
    assert e.reason == "read-only" and e.folder == str(root)
    assert f"{root} is on a read-only file system" in str(e)
    assert f"({e.needed_bytes:,} bytes)" in str(e) and f"({e.free_bytes:,} bytes) free" in str(e)
    assert sorted(p.name for p in root.iterdir()) == ["step_000000001"]
    verify(first)
    f = _check_triage(e, f"{root} is on a read-only file system", "point output_dir")
    assert "remount" in f.suggestions[0]

    missing = disk / "gone" / "deeper" / "checkpoints"
    with pytest.raises(CheckpointStorageError) as ei:
        save_checkpoint(missing, 1, {"small.pt": _small}, needed_bytes=2000)
    e = ei.value
    assert e.reason == "missing" and e.folder == str(missing)
    assert f"{disk / 'gone'} does not exist and cannot be created" in str(e)
    _check_triage(e, f"create {missing}", "point output_dir")
