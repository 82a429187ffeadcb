"""Shared fixtures. Every test session gets its own GPU_LAB_HOME, so the registry and run
directories of the tests never mix with a user's ~/.gpu_lab."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(ROOT))  # `bench.lib`, the benchmarks' method, for their tests


@pytest.fixture
def gpu_lab_home(tmp_path, monkeypatch):
    """A fresh, empty GPU_LAB_HOME for one test."""
    home = tmp_path / "gpu_lab_home"
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def _no_accelerate_state_leaks():
    """Tests that run fit() or an Accelerator in this process must not leave accelerate's shared
    state behind: the next gpu_lab.launch would (rightly) refuse to fork from such a process."""
    yield
    mod = sys.modules.get("accelerate.state")
    if mod is not None:
        mod.AcceleratorState._reset_state(reset_partial_state=True)
