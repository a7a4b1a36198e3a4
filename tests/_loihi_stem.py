"""A small residual network with a max-pooling stem (the analog prefix), converted by snnconv: its
NIR graph's input (the prefix's output) reaches the first block's shortcut beside spikes."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["StemNet", "stem_snn"]


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


class StemNet(nn.Module):
    """conv-BN-ReLU-maxpool stem, two basic blocks (identity shortcuts), global pool, linear."""

    def __init__(self, c: int = 8, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(), nn.MaxPool2d(2))
        self.block1, self.block2 = _Block(c), _Block(c)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.block2(self.block1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def stem_snn(reset: str = "subtract", seed: int = 0, size: int = 12):
    """(snn, calibration images ``[64, 3, size, size]``) of a random-init :class:`StemNet`
    converted at T=8 without training (BatchNorm statistics from the images first)."""
    import snnconv

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = StemNet()
    x = torch.randn(64, 3, size, size, generator=g)
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    loader = [(x[i:i + 32], torch.zeros(32, dtype=torch.long)) for i in range(0, 64, 32)]
    snn, _ = snnconv.convert(model, loader, T=8, finetune_epochs=0, reconstruction_steps=0,
                             reset=reset, progress=False)
    return snn, x
