"""Test doubles for the launch path, for machines without a GPU (CI). Named as doubles on purpose."""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import checks as preflight


class FakeCudaProbe:
    """A stand-in for preflight.real_cuda_probe that reports a chosen CUDA state."""

    def __init__(self, initialized: bool = False, bad_fork: bool = False,
                 fork_poisoned: bool = False) -> None:
        self.state = preflight.CudaState(True, initialized, bad_fork, fork_poisoned)
        self.calls = 0

    def __call__(self) -> preflight.CudaState:
        self.calls += 1
        return self.state


@contextlib.contextmanager
def fake_cuda_state(initialized: bool = False, bad_fork: bool = False,
                    fork_poisoned: bool = False) -> Iterator[FakeCudaProbe]:
    """Within the block, preflight sees the given CUDA state."""
    probe = FakeCudaProbe(initialized, bad_fork, fork_poisoned)
    old, preflight.cuda_probe = preflight.cuda_probe, probe
    try:
        yield probe
    finally:
        preflight.cuda_probe = old
