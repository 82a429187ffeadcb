"""Quick or full mode: the one definition every notebook, benchmark and sizing function reads.

Quick: no GPU (NVML counts none), or GPU_LAB_QUICK=1; GPU_LAB_QUICK=0 forces full mode on any
host. Quick mode sizes work for a CPU laptop (a minute a notebook); full mode uses the sizes a GPU
server is for. Setting the variable is how a test, a bench script or a learner picks a mode;
reading it is this module's alone (tests/test_quick_mode.py checks the tree).
"""
from __future__ import annotations

import os

VARIABLE = "GPU_LAB_QUICK"


def env_flag(name: str) -> bool | None:
    """An on/off environment variable: None when unset or empty, False for 0/false/no, else True."""
    flag = os.environ.get(name, "").strip().lower()
    return None if not flag else flag not in ("0", "false", "no")


def quick() -> bool:
    """True without a GPU (NVML's count) or with GPU_LAB_QUICK=1; GPU_LAB_QUICK=0 forces full."""
    flag = env_flag(VARIABLE)
    if flag is not None:
        return flag
    from .telemetry.probe import gpu_count

    return gpu_count() == 0


def mode() -> str:
    return "quick" if quick() else "full"


def describe(changes: str = "") -> str:
    """The line a tutorial opens with: the mode, why it is that mode, how to pick the other one,
    and `changes`, what the mode changes in that notebook (its sizes)."""
    flag = env_flag(VARIABLE)
    why = (f"{VARIABLE}={os.environ[VARIABLE].strip()}" if flag is not None
           else "no GPU found" if quick() else "a GPU found")
    other = f"{VARIABLE}=0 forces full mode" if quick() else f"{VARIABLE}=1 picks the quick sizes"
    return f"{mode()} mode ({why}; {other})" + (f": {changes}" if changes else "")
