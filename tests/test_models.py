"""The model zoo: every model builds, runs on its input size, and has the documented shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from snnconv import models
from snnconv.graph import call_sites, prepare

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

_SIZE = {"small_cnn": 8}  # the others take 32x32


def test_zoo_names():
    assert models.names() == sorted(["small_cnn", "resnet8", "resnet14", "resnet18", "resnet20",
                                     "vgg11", "vgg16"])


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="resnet18"):
        models.get("resnet1000")


@pytest.mark.parametrize("name", models.names())
def test_zoo_model_runs_with_non_default_classes_and_channels(name):
    torch.manual_seed(0)
    model = models.get(name, num_classes=7, in_channels=1).eval()
    size = _SIZE.get(name, 32)
    with torch.no_grad():
        out = model(torch.randn(2, 1, size, size))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()
    assert any(isinstance(m, _BatchNorm) for m in model.modules())
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())  # no exact spiking max-pool


def test_small_cnn_runs_on_28x28_and_trains():
    model = models.get("small_cnn", num_classes=10, in_channels=1)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name,params", [("small_cnn", 33_130), ("resnet14", 175_258),
                                         ("resnet18", 11_173_962)])
def test_documented_parameter_counts(name, params):
    # small_cnn and resnet14 as their docstrings say; resnet18 is the usual CIFAR ResNet-18
    model = models.get(name, num_classes=10, in_channels=1 if name == "small_cnn" else 3)
    assert sum(p.numel() for p in model.parameters()) == params


def test_resnet_block_calls_one_relu_module_at_two_sites():
    # documented: the QCFS stage must give each call site its own module
    gm = prepare(models.get("resnet8"))
    sites = call_sites(gm)
    assert len(sites["layers.0.0.relu"]) == 2


def test_small_cnn_has_module_functional_and_method_relu_call_sites():
    gm = prepare(models.get("small_cnn"))
    kinds = {(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes}
    assert ("call_method", "relu") in kinds
    assert ("call_function", "relu") in kinds
    assert any(op == "call_module" and target == "relu" for op, target in kinds)
