"""Activation checkpointing: the same gradients, measurably less activation memory (CPU allocator)."""
from __future__ import annotations

import copy

import pytest
import torch

from gpu_lab.models import build
from gpu_lab.train import activation
from train_helpers import one_thread  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads_and_buffers(model, x, y):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return ({k: p.grad.clone() for k, p in model.named_parameters()},
            {k: b.clone() for k, b in model.named_buffers()})


def _small_vgg16():
    """torchvision's vgg16 with its 120M-parameter classifier swapped for a small head: the
    checkpointed part (features) is the real one."""
    torch.manual_seed(0)
    m = build("vgg16", 10, 32)
    m.avgpool = torch.nn.AdaptiveAvgPool2d(1)
    m.classifier = torch.nn.Linear(512, 10)
    return m


@pytest.mark.slow  # over half a second
@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_resnet", "tiny_vit", "resnet18", "vgg16"])
def test_identical_gradients_and_batchnorm_statistics(name):
    torch.manual_seed(0)
    plain = _small_vgg16() if name == "vgg16" else build(name, 10, 32)
    ckpt = copy.deepcopy(plain)
    assert activation.enable(ckpt) > 0 and activation.is_enabled(ckpt)
    assert ckpt.state_dict().keys() == plain.state_dict().keys()  # checkpoints stay compatible
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    g1, b1 = _grads_and_buffers(plain, x, y)
    g2, b2 = _grads_and_buffers(ckpt, x, y)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=0, atol=1e-6)
    for k in b1:  # BatchNorm running stats updated once, not again by the recompute
        torch.testing.assert_close(b2[k], b1[k], rtol=0, atol=0)
    ckpt.eval()  # no checkpointing outside training
    with torch.no_grad():
        torch.testing.assert_close(ckpt(x), plain.eval()(x))


@pytest.mark.parametrize("name, batch", [("tiny_resnet", 32), ("tiny_vit", 32)])
def test_lower_activation_peak_measured_on_cpu(name, batch):
    torch.manual_seed(0)
    plain = build(name, 10, 32)
    ckpt = copy.deepcopy(plain)
    activation.enable(ckpt)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    a = activation.activation_peak(plain, x, y)
    b = activation.activation_peak(ckpt, x, y)
    mib = 1 << 20
    print(f"\n{name}, batch {batch} at 32 px: activations kept for backward "
          f"{a['activation_bytes'] / mib:.2f} MiB -> {b['activation_bytes'] / mib:.2f} MiB "
          f"({100 * (1 - b['activation_bytes'] / a['activation_bytes']):.0f}% less); "
          f"forward+backward peak {a['peak_bytes'] / mib:.2f} -> {b['peak_bytes'] / mib:.2f} MiB "
          f"({100 * (1 - b['peak_bytes'] / a['peak_bytes']):.0f}% less)")
    assert b["activation_bytes"] < 0.8 * a["activation_bytes"]
    assert b["peak_bytes"] < a["peak_bytes"]


def test_a_model_without_known_blocks_is_refused():
    with pytest.raises(ValueError, match="no block gpu_lab knows"):
        activation.enable(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2)))
