"""The zoo's architectures at an eighth of their width: the same layers at a test-sized cost."""

from __future__ import annotations

from snnconv import models
from snnconv.models import vgg


def _narrow_vgg(name: str):
    return lambda c: models.VGG([v // 8 if isinstance(v, int) else v for v in vgg._CFG[name]], 10, c)


NARROW = {
    "small_cnn": lambda c: models.small_cnn(num_classes=10, in_channels=c, width=8),
    "resnet8": lambda c: models.CifarResNet([1, 1, 1], [8, 16, 32], 10, c),
    "resnet14": lambda c: models.CifarResNet([2, 2, 2], [8, 16, 32], 10, c),
    "resnet18": lambda c: models.CifarResNet([2, 2, 2, 2], [8, 16, 32, 64], 10, c),
    "resnet20": lambda c: models.CifarResNet([3, 3, 3], [8, 16, 32], 10, c),
    "vgg11": _narrow_vgg("vgg11"),
    "vgg16": _narrow_vgg("vgg16"),
}
