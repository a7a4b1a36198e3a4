"""Convergence as a safety net: for every construct the converter accepts, a small network with
random weights whose plain spiking form (QCFS at L = T, IF neurons, no calibration) at a large T
computes its ANN.

The thresholds are the largest activation each site sees on the inputs (``percentile=100``), so
on those inputs the clipped ANN that a subtractive-reset IF network tends to as T grows is the
ANN itself: a construct whose spiking form meant something else (a scale absorbed twice, a
shortcut that skips its neuron's scale, a channel order lost) would stay far from it at any T.
Reset to zero has no such limit (its rate on a varying input depends on the input's timing, not
only on its mean), so only subtractive reset is checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv

T_LARGE = 256
TOLERANCE = 0.01  # RMS(SNN - ANN) / RMS(ANN) at T_LARGE (measured: 1e-4 to 2e-3)


def _bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(0.0, 0.3)
    return bn


class Depthwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), _bn(8), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), _bn(8), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), _bn(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.pw(self.dw(self.stem(x))), 1).flatten(1))


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4, bias=False), _bn(16), nn.ReLU())
        self.head = nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(16 * 2 * 2, 10))

    def forward(self, x):
        return self.head(self.b(self.a(x)))


class Bottleneck(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), _bn(16), nn.ReLU(inplace=True))
        self.c1 = nn.Sequential(nn.Conv2d(16, 4, 1, bias=False), _bn(4), nn.ReLU(inplace=True))
        self.c2 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=2, bias=False), _bn(4), nn.ReLU(inplace=True))
        self.c3 = nn.Sequential(nn.Conv2d(4, 16, 1, bias=False), _bn(16))
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = self.relu(x + self.c3(self.c2(self.c1(x))))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(8, 6, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(10, 10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.cat([self.b1(x), self.b2(x)], 1))


class Shuffle(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        x = torch.cat([a, self.branch(b)], 1)
        n, c, h, w = x.shape
        x = x.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)  # channel shuffle
        return self.head(x)


class Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), _bn(8), nn.ReLU6())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Hardtanh(0.0, 0.4))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.b(self.a(x))
        return self.head(torch.clamp(x.mean((2, 3)), 0, 10.0))


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2))
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(3))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 9, 10))

    def forward(self, x):
        return self.head(self.b(self.a(x)))


class Prefix(nn.Module):
    """A ResNet stem (convolution, BatchNorm, ReLU, max-pooling): the analog prefix, then IF."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), _bn(8), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), _bn(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        y = self.stem(x)
        y = F.relu(y + self.body(y))
        return self.head(y.mean((2, 3)))


CONSTRUCTS = {"depthwise": Depthwise, "grouped": Grouped, "bottleneck": Bottleneck, "concatenation": Concat,
              "channel shuffle": Shuffle, "clip at [0, a]": Clipped, "average and adaptive pooling": Pools,
              "analog prefix": Prefix}


@pytest.mark.parametrize("per_channel", [False, True], ids=["per layer", "per channel"])
@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_the_plain_spiking_form_converges_to_the_ann(construct, per_channel):
    torch.manual_seed(0)
    ann = CONSTRUCTS[construct]().eval()
    x = torch.rand(32, 3, 8, 8)
    snn, meta = snnconv.convert(ann, [(x, None)], T=T_LARGE, L=T_LARGE, percentile=100.0, per_channel=per_channel,
                                bias_calibration=False, reconstruction_steps=0, finetune_epochs=0,
                                qcfs_epochs=0, progress=False)
    if construct == "analog prefix":
        assert meta.stage("prepare").changes["constructs"]["prefix"]["nodes"]
    with torch.no_grad():
        want, got = ann(x), snn(x)
    error = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    assert error < TOLERANCE, f"{construct}: relative RMS error {error:.4f} at T={T_LARGE}"
