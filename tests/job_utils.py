"""Helpers for tests that run exported jobs in fresh processes."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent


def job_env(home: Path) -> dict:
    """What a shell on a cluster node would have: torchrun on PATH, the user's module (here
    tests/export_fns.py) importable, and a registry of the test's own."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["GPU_LAB_HOME"] = str(home)
    return env
