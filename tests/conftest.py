"""Shared fixtures. Every test session gets its own GPU_LAB_HOME, so the registry and run
directories of the tests never mix with a user's ~/.gpu_lab."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def gpu_lab_home(tmp_path, monkeypatch):
    """A fresh, empty GPU_LAB_HOME for one test."""
    home = tmp_path / "gpu_lab_home"
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    return home
