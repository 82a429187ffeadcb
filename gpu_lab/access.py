"""Who can read what a run writes: its owner only, unless the owner names a group on purpose.

Contract: a run's folder (GPU_LAB_HOME/runs/<id>) and its output folder (<output_dir>/<run id>,
where its checkpoints go) are mode 0700, the files gpu_lab writes in them 0600, whatever the
process umask: nobody but the owner (and root) can list, read or write them, and so nothing
below them either, whatever mode the training code gives its own files.

GPU_LAB_SHARE_GROUP=<group> shares a team's runs through that group instead: folders 2770 (the
setgid bit makes what is created inside belong to the group too), files 0660. The owner must be a
member of the group. The registry uses the same setting for its own files.
"""
from __future__ import annotations

import grp
import os
from pathlib import Path

SHARE_GROUP = "GPU_LAB_SHARE_GROUP"


def share_gid() -> int | None:
    """The group named by GPU_LAB_SHARE_GROUP (a name or a number), or None (private to the owner).
    The one reading of the setting: run folders and the registry both ask here."""
    raw = os.environ.get(SHARE_GROUP, "").strip()
    if not raw:
        return None
    try:
        return grp.getgrgid(int(raw)).gr_gid if raw.isdigit() else grp.getgrnam(raw).gr_gid
    except KeyError:
        mine = sorted({group_name(g) for g in {os.getegid(), *os.getgroups()}})
        raise ValueError(f"{SHARE_GROUP}={raw!r}: no such group on this host; accepted: the name "
                         f"or id of a group you are in ({', '.join(mine)}; `id -Gn` lists them), "
                         "or unset it to keep runs and the registry readable by you only") from None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def dir_mode() -> int:
    return 0o2770 if share_gid() is not None else 0o700


def file_mode() -> int:
    return 0o660 if share_gid() is not None else 0o600


def private_dir(path: str | os.PathLike) -> Path:
    """Create `path` (and missing parents, with the usual modes) and give it the run-folder mode
    and group: explicitly, since mkdir's mode is cut by the umask."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    gid = share_gid()
    if gid is not None and p.stat().st_gid != gid:
        try:
            os.chown(p, -1, gid)
        except PermissionError:
            raise PermissionError(f"{SHARE_GROUP}: cannot give {p} to group {gid}: you are not a "
                                  f"member of it (`id -Gn` lists your groups)") from None
    os.chmod(p, 0o2770 if gid is not None else 0o700)
    return p


def private_if_new(path: str | os.PathLike) -> Path:
    """private_dir for a folder made here; one that exists keeps the mode its owner gave it."""
    p = Path(path)
    return p if p.is_dir() else private_dir(p)


def touch_private(path: str | os.PathLike) -> None:
    """Make the file, owner-only, before another program opens it for appending with its own
    umask (Slurm's job and rank logs)."""
    os.close(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))


def open_private(path: str | os.PathLike, flags: int) -> int:
    """os.open with the run-file mode, set again on the descriptor (the umask may cut it, and an
    existing file keeps its old mode otherwise)."""
    fd = os.open(path, flags, file_mode())
    try:
        os.fchmod(fd, file_mode())
    except OSError:  # not ours (a file another process made): its folder still guards it
        pass
    return fd
