"""GPU memory that no live gpu_lab run holds: the processes doctor names.

NVML lists the compute processes that hold memory on each GPU. One belongs to a live gpu_lab run
when it is, or descends from, the claimant of a claim held in this host's claims folder
(gpu_lab.supervise.claims.host_queue(): a run's supervisor claims, its ranks are its children).
Every other one is named with its GPU, pid, user, command and memory: a leftover of a killed run,
a kernel that used CUDA, another tool, another user. Runs of any user queue for a GPU while such
processes hold more than GPU_LAB_GPU_BUSY_MIB of it (gpu_lab.supervise.devices).

A process of another pid namespace (another container) has a pid NVML knows and this one does not
see: it is listed as not visible, never guessed. Never touches CUDA: NVML and /proc only.
"""
from __future__ import annotations

import os
from typing import Any

from ..units import fmt_bytes


def run_owners(folder: str | os.PathLike | None = None) -> tuple[dict[int, str], str | None]:
    """({claimant pid: run id} of the claims held on this host, why it is empty if it could not
    be read)."""
    from ..supervise.claims import host_queue

    try:
        rows = host_queue(folder)
    except Exception as exc:  # noqa: BLE001 - an unusable claims folder: say so, name them all
        return {}, f"the host's claims could not be read ({type(exc).__name__}: {exc})"
    return {r.pid: r.run_id for r in rows if r.state == "holding"}, None


def unowned_processes(nvml: Any, handles: list, devices: list[dict],
                      owners: dict[int, str]) -> list[dict]:
    """[{gpu, pid, bytes, user, command}] for each process holding memory on a GPU that belongs
    to no run in `owners` (run_owners()); `bytes` is None where NVML cannot tell."""
    out = []
    for dev, h in zip(devices, handles):
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:  # noqa: BLE001 - NotSupported on this board: nothing to name
            continue
        for p in procs:
            pid = int(getattr(p, "pid", -1))
            if _run_of(pid, owners) is not None:
                continue
            used = getattr(p, "usedGpuMemory", None)
            out.append({"gpu": dev["index"], "pid": pid,
                        "bytes": int(used) if isinstance(used, int) else None, **_who(pid)})
    return out


def _run_of(pid: int, owners: dict[int, str]) -> str | None:
    import psutil

    if pid in owners:
        return owners[pid]
    try:
        parents = psutil.Process(pid).parents()
    except psutil.Error:
        return None
    return next((owners[p.pid] for p in parents if p.pid in owners), None)


def _who(pid: int) -> dict[str, str | None]:
    import psutil

    if pid == os.getpid():
        return {"user": _user(), "command": "this process (it used CUDA)"}
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            user = p.username()
            cmd = " ".join(p.cmdline()) or p.name()
    except psutil.AccessDenied:
        return {"user": None, "command": "(not readable here)"}
    except psutil.Error:
        return {"user": None, "command": "(not visible here: another container, or gone)"}
    return {"user": user, "command": cmd if len(cmd) <= 80 else cmd[:77] + "..."}


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.geteuid())


def advice(procs: list[dict], why: str | None) -> str:
    """The finding's text: who holds what, and what to do."""
    items = "; ".join(
        f"GPU {p['gpu']}: pid {p['pid']} ({p['user'] or 'user unknown'}, {p['command']}) holds "
        f"{fmt_bytes(p['bytes']) if p['bytes'] is not None else 'an amount NVML cannot tell'}"
        for p in procs)
    head = "GPU memory held by no live gpu_lab run"
    if why:
        head += f" (as far as this can tell: {why})"
    return (f"{head}: {items}. Runs queue for a GPU while such processes hold more than "
            f"GPU_LAB_GPU_BUSY_MIB of it. If one is yours and no longer needed (a leftover of a "
            f"killed run, a kernel that used CUDA), end it with `kill <pid>` (`kill -9 <pid>` if "
            f"it stays); otherwise ask its owner.")
