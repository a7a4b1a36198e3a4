"""CIFAR-style ResNets: 3x3 stem, no max-pool, BasicBlocks, projection shortcuts."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["BasicBlock", "CifarResNet", "resnet8", "resnet14", "resnet18", "resnet20"]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU.

    One ``nn.ReLU`` module is called at two places, as in torchvision: the QCFS stage must
    give each call site its own module.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for small images: ``widths[i]`` channels and ``blocks[i]`` BasicBlocks per stage."""

    def __init__(self, blocks: list[int], widths: list[int], num_classes: int = 10,
                 in_channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        layers = []
        in_planes = widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            stride = 1 if i == 0 else 2
            stage = []
            for j in range(n):
                stage.append(BasicBlock(in_planes, w, stride if j == 0 else 1))
                in_planes = w
            layers.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = torch.flatten(self.pool(out), 1)
        return self.fc(out)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """CIFAR ResNet-18: 3x3 stem, no max-pool, [2, 2, 2, 2] blocks of 64..512 channels."""
    return CifarResNet([2, 2, 2, 2], [64, 128, 256, 512], num_classes, in_channels)


def resnet20(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """CIFAR ResNet-20: [3, 3, 3] blocks of 16/32/64 channels."""
    return CifarResNet([3, 3, 3], [16, 32, 64], num_classes, in_channels)


def resnet14(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-14: [2, 2, 2] blocks of 16/32/64 channels (175k parameters)."""
    return CifarResNet([2, 2, 2], [16, 32, 64], num_classes, in_channels)


def resnet8(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-8: [1, 1, 1] blocks of 16/32/64 channels, for fast tests."""
    return CifarResNet([1, 1, 1], [16, 32, 64], num_classes, in_channels)
