"""gpu_lab.models.build: every name in MODEL_NAMES, random init, nothing downloaded."""
from __future__ import annotations

import pytest
import torch

from gpu_lab.config import MODEL_NAMES
from gpu_lab.models import build, check_input, num_parameters
from train_helpers import one_thread  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_downloads(monkeypatch, tmp_path):
    """Any attempt to fetch weights fails the test, and the torch hub cache stays empty."""
    import torch.hub

    def refuse(*a, **kw):
        raise AssertionError(f"tried to download weights: {a[:1]}")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    yield
    assert not (tmp_path / "torch_home").exists()


def test_names_are_exactly_the_config_names():
    assert set(MODEL_NAMES) == {"tiny_cnn", "tiny_resnet", "tiny_vit", "resnet18", "resnet50",
                                "vgg16", "vit_b_16"}


@pytest.mark.parametrize("name, size", [("tiny_cnn", 32), ("tiny_resnet", 32), ("tiny_vit", 32),
                                        ("tiny_cnn", 8), ("tiny_vit", 64), ("resnet18", 32),
                                        ("resnet50", 32), ("vgg16", 32), ("vit_b_16", 32)])
@pytest.mark.slow  # over half a second
def test_build_and_forward(name, size, no_downloads):
    torch.manual_seed(0)
    model = build(name, num_classes=7, image_size=size)
    with torch.no_grad():
        out = model.eval()(torch.randn(1, 3, size, size))
    assert out.shape == (1, 7)
    if name.startswith("tiny"):
        assert num_parameters(model) < 200_000  # learns in seconds on a CPU
    # random init: two builds with different seeds differ
    torch.manual_seed(1)
    other = build(name, num_classes=7, image_size=size)
    pairs = zip(model.state_dict().values(), other.state_dict().values())
    assert any(not torch.equal(a, b) for a, b in pairs)


@pytest.mark.slow  # over half a second
def test_tiny_models_learn_in_seconds():
    """A few dozen steps on a separable toy problem: the loss falls by more than half."""
    torch.manual_seed(0)
    x = torch.randn(64, 3, 16, 16)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    x[:, 1] += y[:, None, None] * 2.0
    for name in ("tiny_cnn", "tiny_resnet", "tiny_vit"):
        model = build(name, 2, 16)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(40):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])


@pytest.mark.parametrize("args, words", [
    (("resnet1000", 10, 32), "accepted: 'tiny_cnn'"),
    (("vit_b_16", 10, 100), "multiple of 16"),
    (("vgg16", 10, 16), ">= 32"),
    (("tiny_cnn", 1, 32), "num_classes"),
])
def test_bad_input_is_named(args, words):
    with pytest.raises(ValueError, match=words.replace("'", ".").replace("(", r"\(")):
        check_input(*args)
    with pytest.raises(ValueError):
        build(*args)
