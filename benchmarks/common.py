"""What the benchmarks share: paths, the command that runs one of their modules in a fresh
process, JSON writing, Fashion-MNIST loaders and the trained BN ResNet (cached)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from snnconv import models
from snnconv.data import fashion_mnist
from snnconv.io.atomic import atomic_write_text
from snnconv.progress import progress_bar

HERE = os.path.dirname(os.path.abspath(__file__))
#: The repository root (the folder holding ``benchmarks/``, ``snnconv/`` and ``backends/``).
ROOT = os.path.dirname(HERE)
#: What the documentation cites.
RESULTS = os.path.join(HERE, "results")
#: The settled studies' results.
STUDIES_RESULTS = os.path.join(HERE, "studies", "results")
#: Trained networks (not in git).
CACHE = os.path.join(RESULTS, "cache")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, with the repository and its backends
    first on ``PYTHONPATH`` (so ``python -m benchmarks...`` runs from any folder)."""
    path = [ROOT, os.path.join(ROOT, "backends")]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def test_helper(name: str) -> ModuleType:
    """A module of the test suite (``tests/<name>.py``: the attack builders, the hand-built NIR
    graphs), loaded from its file, so that a benchmark measures what the tests define. Only for
    modules that import nothing else from ``tests/``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tests", f"{name}.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"no test helper {name!r} under {os.path.join(ROOT, 'tests')}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (``benchmarks.matrix.robustness``) as ``__main__`` in a
    fresh interpreter; run it with ``env=child_env()``."""
    return [sys.executable, "-m", module, *args]


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
