"""Shared fixtures. Every test session gets its own GPU_LAB_HOME, so the registry and run
directories of the tests never mix with a user's ~/.gpu_lab."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

_home = tempfile.mkdtemp(prefix="gpu_lab_test_home_")
os.environ.setdefault("GPU_LAB_HOME", _home)
os.environ.setdefault("GPU_LAB_QUICK", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def gpu_lab_home(tmp_path, monkeypatch):
    """A fresh, empty GPU_LAB_HOME for one test."""
    home = tmp_path / "gpu_lab_home"
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    return home
