"""Synthetic images: deterministic, ImageFolder layout, and learnable (not noise)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_lab.data import SyntheticImages, class_names, make_synthetic_images
from gpu_lab.data.synthetic import MAX_CLASSES


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.*")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_image_folder_layout_balanced_and_deterministic(tmp_path):
    a = make_synthetic_images(tmp_path / "a", 30, image_size=24, num_classes=5, seed=7)
    b = make_synthetic_images(tmp_path / "b", 30, image_size=24, num_classes=5, seed=7)
    c = make_synthetic_images(tmp_path / "c", 30, image_size=24, num_classes=5, seed=8)
    dirs = sorted(p.name for p in a.root.iterdir())
    assert dirs == class_names(5) == a.classes
    for d in dirs:
        files = list((a.root / d).glob("*.jpg"))
        assert len(files) == 6
        with Image.open(files[0]) as im:
            assert im.size == (24, 24) and im.mode == "RGB"
    assert _digest(a.root) == _digest(b.root), "same seed must give byte-identical files"
    assert _digest(a.root) != _digest(c.root), "another seed must give other images"
    assert a.bytes_written == sum(p.stat().st_size for p in a.root.rglob("*.jpg"))
    # a readable repr, not the default's "object at 0x7f…" (a temp path may hold "0x")
    assert "SyntheticImageSet(" in repr(a) and " at 0x" not in repr(a)


def test_png_files_hold_exactly_the_in_memory_images(tmp_path):
    s = make_synthetic_images(tmp_path, 6, image_size=20, num_classes=3, seed=3, fmt="png")
    ds = SyntheticImages(6, image_size=20, num_classes=3, seed=3)
    for i in range(6):
        img, label = ds[i]
        assert img.dtype == torch.float32 and img.shape == (3, 20, 20)
        assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
        png = s.root / s.classes[label] / f"{i:07d}.png"
        arr = np.array(Image.open(png))
        assert torch.equal((img * 255).round().to(torch.uint8), torch.from_numpy(arr).permute(2, 0, 1))


def test_in_memory_dataset_is_deterministic_and_indexable():
    a, b = SyntheticImages(10, 16, 4, seed=1), SyntheticImages(10, 16, 4, seed=1)
    assert len(a) == 10 and a.classes == class_names(4)
    assert torch.equal(a[3][0], b[3][0]) and a[3][1] == 3 % 4
    assert torch.equal(a[-1][0], a[9][0])
    assert not torch.equal(a[3][0], SyntheticImages(10, 16, 4, seed=2)[3][0])
    with pytest.raises(IndexError, match="index 10 out of range"):
        a[10]
    assert repr(a) == "SyntheticImages(n=10, image_size=16, num_classes=4, seed=1)"


def test_classes_are_learnable_by_a_linear_model_in_seconds():
    """Structure, not noise: a softmax regression on 16 px images beats chance by far on
    held-out images (another seed)."""
    torch.manual_seed(0)
    k = 6
    train = SyntheticImages(600, 16, k, seed=0)
    test = SyntheticImages(240, 16, k, seed=1)
    xtr = torch.stack([train[i][0] for i in range(len(train))]).flatten(1)
    ytr = torch.tensor([train[i][1] for i in range(len(train))])
    xte = torch.stack([test[i][0] for i in range(len(test))]).flatten(1)
    yte = torch.tensor([test[i][1] for i in range(len(test))])
    model = torch.nn.Linear(xtr.shape[1], k)
    # SGD, not Adam: Adam.step() asks torch.cuda.is_available(), which marks this process as
    # CUDA-touched, and the gloo ranks later forked from it by gpu_lab.launch would refuse to start.
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(xtr), ytr)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = (model(xte).argmax(1) == yte).float().mean().item()
    print(f"held-out accuracy {acc:.2f} (chance {1 / k:.2f})")
    assert acc > 0.6


@pytest.mark.parametrize("kwargs, field", [
    ({"num_classes": 1}, "num_classes=1"),
    ({"num_classes": MAX_CLASSES + 1}, f"num_classes={MAX_CLASSES + 1}"),
    ({"image_size": 4}, "image_size=4"),
    ({"n": 0}, "n=0"),
    ({"fmt": "gif"}, "fmt='gif'"),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    args = {"n": 4, "image_size": 16, "num_classes": 2, "fmt": "jpg"} | kwargs
    with pytest.raises(ValueError) as e:
        make_synthetic_images(tmp_path, **args)
    assert field in str(e.value)


@pytest.mark.slow  # over half a second
def test_import_gpu_lab_data_is_cheap_and_headless():
    """`import gpu_lab.data` loads no torch; the whole data package never loads widgets."""
    code = ("import sys, gpu_lab.data; assert 'torch' not in sys.modules, 'torch imported'; "
            "import gpu_lab.data.synthetic, gpu_lab.data.shards, gpu_lab.data.loader, "
            "gpu_lab.diagnostics.loaderbench, gpu_lab.cli; "
            "bad = [m for m in ('ipywidgets', 'plotly', 'jupyter_server', 'ipykernel') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
