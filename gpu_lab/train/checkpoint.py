# Long: the writer, its storage-failure diagnosis, pruning and the readers share one on-disk
# layout and its atomicity rules.
"""Atomic checkpoint directories: a crash or a SIGKILL at any moment never leaves a checkpoint that
resume would pick and then fail to load.

Layout, under `<output_dir>/checkpoints/`:

    step_000001200/            a complete checkpoint (only ever created by a rename)
        model.safetensors      weights (safetensors: loading them executes nothing)
        optimizer.pt …         other state, loaded with torch.load(weights_only=True)
        trainer_state.json     step, epoch, data position, config
        manifest.json          written last: every file's size and sha256
    .tmp-step_000001300-<pid>-<token>/   a save in progress (ignored by readers, swept later)
    .trash-…/                  an old checkpoint being pruned (renamed away first, then deleted)

A save writes every file into a temp dir beside the target, fsyncs each file, writes and fsyncs the
manifest, fsyncs the temp dir, renames it to `step_N` (atomic within one file system) and fsyncs the
parent so the rename itself survives a power cut. Old checkpoints are pruned only after that.
Readers take the newest `step_N` whose manifest verifies (sizes and sha256), and never open a file
the manifest does not list.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

FORMAT = "gpu_lab.checkpoint/1"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step_(\d{9,})$")
_FILE = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or holds something we refuse to load."""


class CheckpointStorageError(CheckpointError):
    """A checkpoint the storage could not take: out of space (found before or during the write), a
    read-only folder, no permission, or a folder that cannot be created. The message names the
    checkpoint, the folder, the bytes it needs and the bytes free; the earlier checkpoints are
    untouched and nothing of this one is left behind."""

    def __init__(self, message: str, *, reason: str, checkpoint: str, folder: str,
                 needed_bytes: int | None, free_bytes: int | None,
                 keep_last: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.checkpoint, self.folder = reason, checkpoint, folder
        self.needed_bytes, self.free_bytes, self.keep_last = needed_bytes, free_bytes, keep_last


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def meta(self) -> dict:
        return self.manifest.get("meta", {})


def checkpoint_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step_{int(step):09d}"


# --- low-level durability helpers -----------------------------------------------------------------
def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


# --- writing ----------------------------------------------------------------------------------------
Writer = Callable[[Path], None]


def save_checkpoint(root: str | os.PathLike, step: int, files: Mapping[str, Writer],
                    meta: Mapping[str, Any] | None = None, keep_last: int | None = None,
                    needed_bytes: int | None = None) -> Path:
    """Write one checkpoint atomically and return its path.

    `files` maps a plain file name to a function that writes that file at the given path (the
    function need not fsync; this does). `meta` is stored in the manifest. With `keep_last`, older
    complete checkpoints beyond that number are pruned after the new one is in place.
    `needed_bytes`: the size of what the writers will write; when the file system has less room
    than that, nothing is written. Storage failures (out of space before or during the write, a
    read-only folder, a folder that cannot be created) raise CheckpointStorageError.
    """
    root = Path(root)
    name = step_name(step)
    need = None if needed_bytes is None else _on_disk(root, int(needed_bytes), len(files) + 1)

    def failure(reason: str, free: int | None, detail: str = "") -> CheckpointStorageError:
        return CheckpointStorageError(
            storage_message(reason, name, root, need, free, keep_last, detail), reason=reason,
            checkpoint=name, folder=str(root), needed_bytes=need, free_bytes=free,
            keep_last=keep_last)

    try:
        from ..access import private_if_new
        private_if_new(root)  # made here: the owner's only (gpu_lab.access)
    except OSError as e:
        missing = _missing_ancestor(root)
        reason = "missing" if missing is not None else (_storage_reason(e) or "permission")
        detail = (f"{missing} does not exist and cannot be created: {e.strerror or e}"
                  if missing is not None else str(e.strerror or e))
        raise failure(reason, free_space(root), detail) from e
    sweep(root)
    free = free_space(root)
    if need is not None and free is not None and need > free:
        raise failure("space", free)
    tmp = root / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    final = root / name
    try:
        tmp.mkdir()
        _write_files(tmp, step, files, meta)
        if final.exists():  # re-saving a step (e.g. a resumed run): move the old one aside first
            _discard(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException as e:
        written = _tree_bytes(tmp)
        left = free_space(root)  # before the temp dir goes: what the failed write had left
        shutil.rmtree(tmp, ignore_errors=True)
        reason = _write_failure_reason(e, left, (need or 0) - written)
        if reason is not None:
            _drop_frames(e)
            raise failure(reason, free, f"{type(e).__name__}: {e} (after writing {written:,} "
                                        f"bytes)") from e
        raise
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _write_files(tmp: Path, step: int, files: Mapping[str, Writer], meta: Mapping | None) -> None:
    """Every file into `tmp`, fsynced, then the manifest that lists them, then `tmp` itself."""
    entries = {}
    for fname, writer in files.items():
        if not _FILE.match(fname) or fname == MANIFEST:
            raise ValueError(f"checkpoint file name {fname!r}: expected letters, digits, '._-' "
                             f"and not {MANIFEST!r}")
        p = tmp / fname
        writer(p)
        if not p.is_file():
            raise CheckpointError(f"checkpoint writer for {fname!r} did not create {p}")
        fsync_file(p)
        entries[fname] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, "step": int(step), "created": time.time(),
                "files": entries, "meta": dict(meta or {})}
    write_json(tmp / MANIFEST, manifest)  # last: its presence means every file above is whole
    fsync_dir(tmp)


def _write_failure_reason(e: BaseException, left: int | None, still_needed: int) -> str | None:
    """The storage reason a failed write gives, or None (then it is not a storage failure)."""
    if not isinstance(e, Exception):
        return None
    reason = _storage_reason(e)
    if reason is None and left is not None and left < max(still_needed, _FULL):
        # some writers say nothing useful on a full disk (torch.save: "unexpected pos ..."):
        # a file system without room for the rest of the checkpoint is the explanation
        reason = "space"
    return reason


def _drop_frames(e: BaseException) -> None:
    """A failed torch.save keeps its file open from the frames of its tracebacks, and an unlinked
    open file keeps its space: drop the frames' locals to give it back now."""
    chained: BaseException | None = e
    for _ in range(16):  # a chain is short; the bound guards against a hand-made cycle
        if chained is None:
            break
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__


# below this many free bytes a file system counts as full when a write fails without a reason
_FULL = 64 * 1024


def free_space(folder: str | os.PathLike) -> int | None:
    """Bytes a process may still write in the file system that holds `folder` (or its nearest
    existing parent); None where that cannot be asked."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _on_disk(folder: Path, size: int, n_files: int) -> int:
    """`size` bytes of data in `n_files` files (plus their folder) as the file system counts them:
    each file rounded up to whole blocks."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        block = os.statvfs(p).f_frsize or 4096
    except (OSError, AttributeError):  # AttributeError: Windows has no statvfs
        block = 4096
    return size + (n_files + 1) * block


def _tree_bytes(folder: Path) -> int:
    try:
        return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    except OSError:
        return 0


def _missing_ancestor(folder: Path) -> Path | None:
    """The highest missing folder on the way down to `folder`'s parent, or None."""
    missing = None
    for p in folder.parents:
        if p.exists():
            break
        missing = p
    return missing


_ERRNO_REASONS = {getattr(errno, name): reason for name, reason in (
    ("ENOSPC", "space"), ("EDQUOT", "space"), ("EROFS", "read-only"), ("EACCES", "permission"),
    ("EPERM", "permission")) if hasattr(errno, name)}
_TEXT_REASONS = (("No space left on device", "space"), ("os error 28", "space"),
                 ("Disk quota exceeded", "space"), ("Read-only file system", "read-only"),
                 ("os error 30", "read-only"), ("Permission denied", "permission"))


def _storage_reason(exc: BaseException) -> str | None:
    """'space', 'read-only' or 'permission' when `exc` (or what caused it) is that kind of storage
    failure; writers in other languages (safetensors, torch's zip writer) only say it in words."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _ERRNO_REASONS:
            return _ERRNO_REASONS[exc.errno]
        text = str(exc)
        for needle, reason in _TEXT_REASONS:
            if needle in text:
                return reason
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def storage_message(reason: str, checkpoint: str, folder: Path, needed: int | None,
                    free: int | None, keep_last: int | None, detail: str = "") -> str:
    """The CheckpointStorageError text: what went wrong, with the bytes needed and free."""
    what = {"space": f"not enough space in {folder}",
            "read-only": f"{folder} is on a read-only file system",
            "permission": f"no permission to write in {folder}",
            "missing": f"the folder {folder} cannot be created"}[reason]
    need = "an unknown number of bytes" if needed is None else \
        f"about {_human(needed)} ({needed:,} bytes)"
    room = "unknown" if free is None else f"{_human(free)} ({free:,} bytes)"
    s = f"checkpoint {checkpoint}: {what}: it needs {need}; {room} free"
    if keep_last is not None:
        s += f" (keep_last={keep_last})"
    if detail:
        s += f". {detail}"
    return s + (". Nothing of this checkpoint was left behind; the earlier checkpoints are "
                "untouched.")


def _human(n: int) -> str:
    from ..units import fmt_bytes

    return fmt_bytes(n)


def _discard(path: Path) -> None:
    """Rename away, then delete: a crash half-way leaves a .trash dir, never a half step_N dir."""
    trash = path.parent / f".trash-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; returns what was removed."""
    if keep_last < 1:
        raise ValueError(f"keep_last: got {keep_last!r}; accepted: an int >= 1")
    removed = []
    for info in list_checkpoints(root, verify_files=False)[:-keep_last]:
        _discard(info.path)
        removed.append(info.path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(root: str | os.PathLike) -> None:
    """Remove leftovers of saves and prunes whose process is gone (a SIGKILL mid-save)."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        m = re.match(r"^\.(tmp|trash)-.*-(\d+)-[0-9a-f]+$", p.name)
        if not m:
            continue
        pid = int(m.group(2))
        ours = pid == os.getpid()
        if (ours and m.group(1) == "trash") or (not ours and not _pid_alive(pid)):
            shutil.rmtree(p, ignore_errors=True)


# --- reading ----------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    mp = path / MANIFEST
    try:
        manifest = json.loads(mp.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (an incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and _FILE.match(k) for k in files):
        raise CheckpointError(f"{path}: {MANIFEST} lists invalid file names")
    return manifest


def verify(path: str | os.PathLike, check_hashes: bool = True) -> dict:
    """The manifest of checkpoint `path` after checking that every listed file is there with its
    size (and sha256); raises CheckpointError naming the first bad file."""
    path = Path(path)
    manifest = read_manifest(path)
    for fname, entry in manifest["files"].items():
        p = path / fname
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: {fname} is missing") from None
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path}: {fname} has {size} bytes, the manifest says {entry.get('bytes')}")
        if check_hashes and sha256_file(p) != entry.get("sha256"):
            raise CheckpointError(f"{path}: {fname} does not match its sha256 in the manifest")
    return manifest


def list_checkpoints(root: str | os.PathLike, verify_files: bool = False) -> list[CheckpointInfo]:
    """Checkpoints under `root` with a readable manifest, oldest first (with `verify_files`, only
    those whose files all match their manifest)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            manifest = verify(p) if verify_files else read_manifest(p)
        except CheckpointError as e:
            log.warning("ignoring checkpoint %s: %s", p, e)
            continue
        out.append(CheckpointInfo(path=p, step=int(m.group(1)), manifest=manifest))
    return sorted(out, key=lambda i: i.step)


def latest_checkpoint(root: str | os.PathLike) -> CheckpointInfo | None:
    """The newest checkpoint under `root` whose manifest and files verify, or None."""
    for info in reversed(list_checkpoints(root, verify_files=False)):
        try:
            verify(info.path)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", info.path, e)
            continue
        return info
    return None


def checkpoint_file(path: str | os.PathLike, fname: str, manifest: Mapping | None = None) -> Path:
    """Path of `fname` inside checkpoint `path`, refusing names the manifest does not list."""
    manifest = manifest if manifest is not None else read_manifest(path)
    if fname not in manifest["files"]:
        raise CheckpointError(f"{path}: {fname} is not listed in {MANIFEST}; refusing to load it")
    return Path(path) / fname


def load_object(path: str | os.PathLike, fname: str, manifest: Mapping | None = None) -> Any:
    """torch.load one listed file with weights_only=True: tensors, numbers, strings, lists, dicts —
    a pickle that tries to build any other object (and so run code) is refused."""
    import pickle

    import torch

    p = checkpoint_file(path, fname, manifest)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{p}: refused to load: it holds objects other than tensors and plain "
                              f"data (torch.load weights_only=True): {str(e).splitlines()[0]}") from None


def load_tensors(path: str | os.PathLike, fname: str = "model.safetensors",
                 manifest: Mapping | None = None) -> dict:
    """The tensors of a listed safetensors file (a format that cannot execute code)."""
    from safetensors.torch import load_file

    return load_file(str(checkpoint_file(path, fname, manifest)), device="cpu")


def load_json(path: str | os.PathLike, fname: str, manifest: Mapping | None = None) -> Any:
    return json.loads(checkpoint_file(path, fname, manifest).read_text())


__all__ = ["CheckpointError", "CheckpointStorageError", "CheckpointInfo", "free_space", "checkpoint_dir", "save_checkpoint", "prune", "sweep",
           "verify", "read_manifest", "list_checkpoints", "latest_checkpoint", "load_object",
           "load_tensors", "load_json", "step_name"]
