"""Tiny image classifiers that learn something in seconds on a CPU.

They mirror the structure of their torchvision namesakes (a conv stack, residual blocks, a vision
transformer), so every switch of the fit loop (activation checkpointing, channels_last, bf16) has
the same code path to exercise on a laptop as on a GPU server.
"""
from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """conv 3×3 → BatchNorm → ReLU → 2×2 max-pool: one stage of TinyCNN (a checkpointing unit)."""

    def __init__(self, cin: int, cout: int, pool: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.bn(self.conv(x))))


class TinyCNN(nn.Module):
    """Three conv stages (16 → 32 → 64 channels), global average pool, linear head (~25k params)."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(ConvBlock(3, w), ConvBlock(w, 2 * w), ConvBlock(2 * w, 4 * w, pool=False))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class TinyBasicBlock(nn.Module):
    """The ResNet basic block (two 3×3 convs and a shortcut), at small width."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class TinyResNet(nn.Module):
    """A CIFAR-style ResNet: 3×3 stem, three stages of basic blocks (16, 32, 64 channels)."""

    def __init__(self, num_classes: int = 10, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1)) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                                  nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        cin = w
        for i, n in enumerate(blocks):
            cout = w * 2 ** i
            for j in range(n):
                layers.append(TinyBasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def tiny_vit(num_classes: int, image_size: int):
    """torchvision's VisionTransformer at toy size: 8×8 patches of the image, 2 layers, 64 wide.

    It has no BatchNorm (LayerNorm is per sample), so its gradients do not depend on how a batch
    is split into micro-batches — the gradient-accumulation test relies on that.
    """
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=image_size, patch_size=image_size // 8, num_layers=2,
                             num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=num_classes)
