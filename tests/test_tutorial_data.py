"""The tutorials' input-size data: classes told apart by fine texture, drawn large and downsampled."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_lab.data import SyntheticImages, make_synthetic_images
from gpu_lab.data.synthetic import TEXTURE_CLASSES, class_spec, render


def test_texture_classes_differ_only_in_texture():
    specs = [class_spec(c) for c in TEXTURE_CLASSES]
    assert len({s[:2] for s in specs}) == 1 and len({s[2] for s in specs}) == len(specs)


def test_render_size_is_the_area_mean_of_the_large_image():
    ds = SyntheticImages(4, 16, 3, seed=5, class_ids=TEXTURE_CLASSES, render_size=96)
    img, label = ds[2]
    big = render(2, TEXTURE_CLASSES[label], 96, 5).astype(np.float64)
    boxed = big.reshape(16, 6, 16, 6, 3).mean(axis=(1, 3)) / 255.0
    assert img.shape == (3, 16, 16)
    assert np.abs(img.permute(1, 2, 0).numpy() - boxed).max() <= 1 / 255 + 1e-6
    # not the image drawn at 16 px directly: that one aliases the stripes instead of averaging them
    direct = torch.from_numpy(render(2, TEXTURE_CLASSES[label], 16, 5)).permute(2, 0, 1) / 255
    assert (img - direct).abs().max() > 0.1
    assert "render_size=96" in repr(ds) and "class_ids=[72, 144, 216]" in repr(ds)


def test_small_inputs_lose_the_texture():
    """Image i of two classes has the same geometry and colours, only another texture: the
    difference between its stripes and its checks version shrinks as the input shrinks (the pattern
    averages away), the reason the size experiment can find a gain."""
    def difference(size):
        a = SyntheticImages(40, size, 2, seed=1, class_ids=[72, 216], render_size=96)
        b = SyntheticImages(40, size, 2, seed=1, class_ids=[216, 72], render_size=96)
        return float(np.mean([float((a[i][0] - b[i][0]).abs().mean()) for i in range(0, 40, 2)]))

    d = [difference(s) for s in (16, 24, 32, 96)]
    assert d == sorted(d) and d[0] < 0.75 * d[-1], d


def test_image_folder_with_class_ids(tmp_path):
    s = make_synthetic_images(tmp_path, 6, image_size=24, num_classes=3, class_ids=TEXTURE_CLASSES)
    assert s.classes == ["000_red_disk_stripes", "001_red_disk_dots", "002_red_disk_checker"]
    assert sorted(p.name for p in tmp_path.iterdir()) == s.classes
    assert all(len(list((tmp_path / c).glob("*.jpg"))) == 2 for c in s.classes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_classes=3, class_ids=[72, 72, 144]), "distinct"),
    (dict(num_classes=2, class_ids=[72, 999]), r"\[0, 288\)"),
    (dict(num_classes=10, class_ids=TEXTURE_CLASSES), "num_classes=len"),
    (dict(num_classes=3, class_ids=TEXTURE_CLASSES, render_size=8), "at least image_size"),
])
def test_bad_class_ids_or_render_size_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticImages(4, 16, **kwargs)
