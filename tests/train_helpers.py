"""Helpers shared by the gpu_lab.train tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=False)
def one_thread():
    """One intra-op thread for the test: on a shared 2-core CI box, OpenMP's spinning threads make
    the tiny models 30-70× slower than one thread does (measured: 0.9 s vs 0.03 s per step)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_images(n: int = 64, size: int = 16, classes: int = 4, seed: int = 0):
    """A fixed TensorDataset of random images and labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, size, size, generator=g),
                                          torch.randint(0, classes, (n,), generator=g))
