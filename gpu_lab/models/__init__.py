"""gpu_lab.models: the image classifiers a TrainConfig can name.

    build("resnet18", num_classes=10, image_size=224)

torchvision's resnet18 / resnet50 / vgg16 / vit_b_16 are built with random initialisation
(`weights=None`: nothing is ever downloaded); tiny_cnn / tiny_resnet / tiny_vit learn something in
seconds on a CPU. Importing this module does not import torch.
"""
from __future__ import annotations

from ..config import MODEL_NAMES

# What each model needs of the input size (checked before any process starts).
_MIN_SIZE = {"vgg16": 32, "resnet18": 32, "resnet50": 32, "tiny_cnn": 8, "tiny_resnet": 8,
             "tiny_vit": 8, "vit_b_16": 16}
_MULTIPLE_OF = {"tiny_vit": 8, "vit_b_16": 16}  # patch grids must tile the image exactly


def check_input(name: str, num_classes: int, image_size: int) -> None:
    """Raise ValueError when `name` cannot be built for this input; names what is accepted."""
    if name not in MODEL_NAMES:
        raise ValueError(f"model: got {name!r}; accepted: {', '.join(map(repr, MODEL_NAMES))}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes: got {num_classes!r}; accepted: an int >= 2")
    if isinstance(image_size, bool) or not isinstance(image_size, int):
        raise ValueError(f"image_size: got {image_size!r}; accepted: an int")
    lo = _MIN_SIZE[name]
    if image_size < lo:
        raise ValueError(f"image_size: got {image_size} for model {name!r}; accepted: >= {lo} "
                         f"(its down-sampling stages need at least {lo}×{lo} pixels)")
    k = _MULTIPLE_OF.get(name)
    if k and image_size % k:
        raise ValueError(f"image_size: got {image_size} for model {name!r}; accepted: a multiple of "
                         f"{k} (the patch grid must tile the image), e.g. {max(k, image_size // k * k)}")


def build(name: str, num_classes: int = 10, image_size: int = 32):
    """Build model `name` (one of MODEL_NAMES) for `num_classes` classes and square `image_size`
    inputs, randomly initialised. The caller seeds torch first if it wants a reproducible init."""
    check_input(name, num_classes, image_size)
    from . import tiny

    if name == "tiny_cnn":
        return tiny.TinyCNN(num_classes)
    if name == "tiny_resnet":
        return tiny.TinyResNet(num_classes)
    if name == "tiny_vit":
        return tiny.tiny_vit(num_classes, image_size)
    import torchvision.models as tvm

    if name == "vit_b_16":
        return tvm.vit_b_16(weights=None, num_classes=num_classes, image_size=image_size)
    # resnet18 / resnet50 / vgg16: fully convolutional up to an adaptive pool, any size >= 32 works
    return getattr(tvm, name)(weights=None, num_classes=num_classes)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["build", "check_input", "num_parameters", "MODEL_NAMES"]
