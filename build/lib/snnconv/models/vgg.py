"""VGG for small images, with average pooling (max-pooling has no exact spiking equivalent)."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["VGG", "vgg11", "vgg16"]

_CFG = {
    "vgg11": [64, "P", 128, "P", 256, 256, "P", 512, 512, "P", 512, 512, "P"],
    "vgg16": [64, 64, "P", 128, 128, "P", 256, 256, 256, "P", 512, 512, 512, "P",
              512, 512, 512, "P"],
}


class VGG(nn.Module):
    """conv3x3-BN-ReLU stacks, 2x2 average pooling, global average pool, one linear layer."""

    def __init__(self, cfg: list, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for v in cfg:
            if v == "P":
                layers.append(nn.AvgPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1, bias=False), nn.BatchNorm2d(v),
                           nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def vgg16(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-16 (13 convolutions) with average pooling, for 32x32 inputs."""
    return VGG(_CFG["vgg16"], num_classes, in_channels)


def vgg11(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-11 (8 convolutions) with average pooling, for 32x32 inputs."""
    return VGG(_CFG["vgg11"], num_classes, in_channels)
