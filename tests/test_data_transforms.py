"""build_transform's fast path for decoded uint8 tensors gives exactly what the v2 pipeline gives
for the same RNG state (random crop, its fallback on extreme aspect ratios, flip, eval resize and
centre crop, normalisation), and everything else still goes through v2."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from gpu_lab.data.transforms import ImageTransform, build_transform, normalize_batch


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 40, 56), (3, 64, 64), (3, 33, 17),
              (3, 8, 120), (3, 120, 8)]  # ratios far outside 3/4..4/3: the centre-crop fallback
    return [torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for s in shapes]


@pytest.mark.parametrize("train, augment", [(True, "basic"), (True, "none"), (False, "basic"),
                                            (False, "none")])
@pytest.mark.parametrize("normalize", [False, True])
def test_fast_path_equals_v2_for_the_same_seed(train, augment, normalize):
    tf = build_transform(train, 24, augment, crop_scale=(0.05, 1.0), normalize=normalize)
    assert isinstance(tf, ImageTransform)
    for seed in range(20):
        for img in _images():
            torch.manual_seed(seed)
            fast = tf(img)
            torch.manual_seed(seed)
            ref = torch.as_tensor(tf.v2(img))
            assert fast.shape == ref.shape == (3, 24, 24)
            assert fast.dtype == ref.dtype == (torch.float32 if normalize else torch.uint8)
            assert torch.allclose(fast.float(), ref.float(), atol=1e-5), (seed, img.shape)


def test_other_inputs_and_autoaugment_go_through_v2():
    tf = build_transform(True, 16, "basic")
    pil = v2.functional.to_pil_image(_images()[0])
    assert tf(pil).shape == (3, 16, 16)                       # PIL image
    assert tf(torch.rand(3, 20, 20)).dtype == torch.float32   # float tensor in [0, 1]
    assert isinstance(build_transform(True, 16, "autoaugment"), v2.Compose)


def test_normalize_batch_cpu_matches_the_formula_and_leaves_its_input_alone():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    want = (x.float() / 255 - mean) / std
    assert torch.allclose(normalize_batch(x), want, atol=1e-5)
    f = x.float()
    before = f.clone()
    normalize_batch(f)  # a float input is copied, never scaled in place
    assert torch.equal(f, before)
    out = torch.empty(x.shape)
    assert normalize_batch(x, out=out) is out and torch.allclose(out, want, atol=1e-5)
