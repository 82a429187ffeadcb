"""Shared fixtures. Every test session gets its own GPU_LAB_HOME, so the registry and run
directories of the tests never mix with a user's ~/.gpu_lab."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(ROOT))  # `bench.lib`, the benchmarks' method, for their tests

from kernel_utils import kernels  # noqa: E402, F401 - real kernels, for any test that asks


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


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def namespace():
    """Another host: a network namespace joined to this one by a veth pair with 10.x addresses
    (root can make one); yields (prefix for commands in it, this side's address, this side's
    interface, its interface). Its address is this side's with .2 for .1. Removed after."""
    n = os.getpid() % 200 + 20
    ns, host_if, ns_if = f"gpulab{n}", f"glh{n}", f"gln{n}"
    made = _sh("ip", "netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"this machine refuses network namespaces (ip netns add: "
                    f"{made.stderr.strip()}); the loopback test still runs")
    steps = [("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if),
             ("ip", "link", "set", ns_if, "netns", ns),
             ("ip", "addr", "add", f"10.79.{n}.1/24", "dev", host_if),
             ("ip", "link", "set", host_if, "up"),
             ("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.79.{n}.2/24", "dev", ns_if),
             ("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"),
             ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")]
    try:
        for step in steps:
            done = _sh(*step)
            assert done.returncode == 0, (step, done.stderr)
        yield ["ip", "netns", "exec", ns], f"10.79.{n}.1", host_if, ns_if
    finally:
        _sh("ip", "link", "del", host_if)  # removes its peer too
        _sh("ip", "netns", "del", ns)
