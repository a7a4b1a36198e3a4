"""torchvision's classifiers as a user brings them, for coverage checks and benchmarks.

:data:`RELU_FAMILY` lists the ReLU-family classifiers (each converts, exports to NIR and runs on
the cpu backend) with the small input the test suite builds each at (32 px, or the smallest size
its torchvision builder takes or at which it stays quick; a ``ceil_mode`` pooling that adds a
window is written exactly, :mod:`snnconv.constructs.pools`); ``large`` marks those
only the benchmark builds. :data:`NO_IF_FORM` lists classifiers with a construct that has no IF
form, and the construct. :func:`build` makes one with ``num_classes=10`` and BatchNorm statistics
from a few random batches (weights as torchvision initialises them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["TVModel", "RELU_FAMILY", "NO_IF_FORM", "build"]


@dataclass(frozen=True)
class TVModel:
    """One torchvision classifier: its builder's name, the input side and whether it is large."""

    name: str
    size: int = 32
    large: bool = False
    kwargs: tuple = ()


RELU_FAMILY: tuple[TVModel, ...] = (
    TVModel("resnet18"), TVModel("resnet50", large=True),
    TVModel("resnext50_32x4d", large=True), TVModel("wide_resnet50_2", large=True),
    TVModel("vgg11"), TVModel("vgg11_bn"), TVModel("vgg16_bn", large=True),
    TVModel("alexnet", size=64),
    TVModel("squeezenet1_0", size=35), TVModel("squeezenet1_1"),
    TVModel("densenet121", large=True),
    TVModel("googlenet", size=45, kwargs=(("aux_logits", False), ("init_weights", True))),
    TVModel("inception_v3", size=75, large=True,
            kwargs=(("aux_logits", False), ("init_weights", True))),
    TVModel("mobilenet_v2"), TVModel("mnasnet0_5"), TVModel("shufflenet_v2_x0_5"),
    TVModel("regnet_x_400mf"),
)

#: Classifiers refused by name, and the construct that has no IF form.
NO_IF_FORM: tuple[tuple[TVModel, str], ...] = (
    (TVModel("mobilenet_v3_small"), "Hardswish"),
    (TVModel("efficientnet_b0"), "SiLU"),
    (TVModel("regnet_y_400mf"), "Sigmoid"),  # squeeze-excitation: a product of two signals
    (TVModel("convnext_tiny", large=True), "GELU"),
)


def build(spec: TVModel, *, seed: int = 0, batches: int = 3, batch_size: int = 8) -> nn.Module:
    """``spec``'s model (``num_classes=10``) in eval mode, its BatchNorm statistics from
    ``batches`` random batches."""
    import torchvision.models as tvm

    torch.manual_seed(seed)
    model = getattr(tvm, spec.name)(num_classes=10, **dict(spec.kwargs))
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.momentum = None  # a cumulative average over the batches
    model.train()
    with torch.no_grad():
        for _ in range(batches if bns else 0):
            model(torch.randn(batch_size, 3, spec.size, spec.size))
    return model.eval()
