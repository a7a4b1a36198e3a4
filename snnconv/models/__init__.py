"""A small model zoo of ReLU CNNs with BatchNorm, the networks snnconv is tested on.

All take ``num_classes`` and ``in_channels``; ``get(name, **kw)`` builds one by name.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from snnconv.errors import ConfigError
from snnconv.models.resnet import BasicBlock, CifarResNet, resnet8, resnet14, resnet18, resnet20
from snnconv.models.small import SmallCNN, small_cnn
from snnconv.models.vgg import VGG, vgg11, vgg16

__all__ = ["get", "names", "BasicBlock", "CifarResNet", "resnet8", "resnet14", "resnet18",
           "resnet20", "VGG", "vgg11", "vgg16", "SmallCNN", "small_cnn"]

_ZOO: dict[str, Callable[..., nn.Module]] = {
    "small_cnn": small_cnn,
    "resnet8": resnet8,
    "resnet14": resnet14,
    "resnet18": resnet18,
    "resnet20": resnet20,
    "vgg11": vgg11,
    "vgg16": vgg16,
}


def names() -> list[str]:
    """Names accepted by :func:`get`."""
    return sorted(_ZOO)


def get(name: str, **kwargs) -> nn.Module:
    """Build zoo model ``name`` (``num_classes``, ``in_channels`` and others as keywords)."""
    try:
        factory = _ZOO[name]
    except KeyError:
        raise ConfigError(f"unknown model '{name}'; choose one of {names()}") from None
    return factory(**kwargs)
