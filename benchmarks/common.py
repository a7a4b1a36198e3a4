"""What the benchmarks share: Fashion-MNIST loaders and the trained BN ResNet (cached)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from snnconv import models  # noqa: E402
from snnconv.data import fashion_mnist  # noqa: E402
from snnconv.io.atomic import atomic_write_text  # noqa: E402
from snnconv.progress import progress_bar

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CACHE = os.path.join(RESULTS, "cache")


class FlipDataset(torch.utils.data.Dataset):
    """Random horizontal flips over a TensorDataset (training augmentation)."""

    def __init__(self, base: TensorDataset, seed: int = 0):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, y


def loaders(batch_size: int = 128, seed: int = 0, augment: bool = False):
    """(train, test) loaders over the real Fashion-MNIST (60k / 10k)."""
    train_set = fashion_mnist(train=True)
    test_set = fashion_mnist(train=False)
    if augment:
        train_set = FlipDataset(train_set)
    train = DataLoader(train_set, batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    test = DataLoader(test_set, batch_size=500)
    return train, test


def trained_ann(name: str = "resnet14", epochs: int = 3, seed: int = 0, progress: bool = True):
    """The BN ResNet trained on Fashion-MNIST; cached under results/cache (state dict only).

    SGD Nesterov 0.9, batch 128, weight decay 5e-4, OneCycle with peak 0.1, flip augmentation.
    """
    key = f"{name}-fmnist-e{epochs}-s{seed}"
    path = os.path.join(CACHE, f"{key}.pt")
    model = models.get(name, num_classes=10, in_channels=1)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), {"cached": True}
    torch.manual_seed(seed)
    train, _ = loaders(128, seed, augment=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=epochs * len(train))
    t0 = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        bar = progress_bar(train, desc=f"ANN epoch {epoch + 1}/{epochs}", disable=not progress)
        for x, y in bar:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    os.makedirs(CACHE, exist_ok=True)
    tmp = path + ".tmp"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model.eval(), {"cached": False, "train_seconds": time.perf_counter() - t0}


def write_json(obj, path):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def randomise_bn(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial BatchNorm statistics (an untrained zoo network converted for speed checks)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                n = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.2 * torch.randn(n, generator=g))
    return model.eval()
