"""A small BN CNN for 8x8 digits and 28x28 Fashion-MNIST: the embedded demo network."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SmallCNN", "small_cnn"]


class SmallCNN(nn.Module):
    """conv-BN-ReLU x2, average pool, conv-BN-ReLU, global average pool, linear-BN-ReLU, linear.

    Uses module, functional and method ReLU call sites, so conversion sees all three forms.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.pool = nn.AvgPool2d(2)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(2 * width)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * width, 2 * width)
        self.bn4 = nn.BatchNorm1d(2 * width)
        self.fc2 = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = self.bn3(self.conv3(x)).relu()
        x = torch.flatten(self.gap(x), 1)
        x = torch.relu(self.bn4(self.fc1(x)))
        return self.fc2(x)


def small_cnn(num_classes: int = 10, in_channels: int = 1, width: int = 32) -> SmallCNN:
    """The demo network (about 33k parameters at width 32)."""
    return SmallCNN(num_classes, in_channels, width)
