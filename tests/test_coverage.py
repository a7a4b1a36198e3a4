"""torchvision's ReLU-family classifiers convert, export to NIR and run on the cpu backend
bit-identically to the torch SNN; what has no IF form is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.backends import get
from snnconv.constructs.prefix import analog_prefix
from snnconv.errors import UnsupportedLayerError
from snnconv.models.tv import NO_IF_FORM, RELU_FAMILY, build

pytest.importorskip("torchvision")

_SMALL = [s for s in RELU_FAMILY if not s.large]
_REFUSED = [(s, why) for s, why in NO_IF_FORM if not s.large]


def _random_batches(size: int, n: int = 2, batch: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(n)]


@pytest.mark.parametrize("spec", _SMALL, ids=[s.name for s in _SMALL])
def test_a_torchvision_classifier_converts_exports_and_runs_bit_identically(spec):
    model = build(spec)
    loader = _random_batches(spec.size)
    snn, meta = snnconv.convert(model, loader, T=4, qcfs_epochs=0, finetune_epochs=0,
                                bias_calibration=False, progress=False, on_collapse="warn")
    snnconv.assert_no_batchnorm(snn)
    assert meta.settings["qcfs_epochs"] == 0 and "finetune" not in [r.name for r in meta.stages]
    graph = snnconv.export_nir(snn)
    x = loader[0]
    stem = analog_prefix(snn)
    assert (stem is not None) == ("input" in graph.metadata)
    with torch.no_grad():
        ref, counts = snn.run(x, 4, spike_counts=True)
        result = get("cpu").compile(graph).run(stem(x) if stem is not None else x, 4)
    assert torch.equal(result.outputs, ref), (result.outputs - ref).abs().max()
    assert set(result.spikes) == set(counts)
    for name, c in counts.items():
        assert torch.equal(result.spikes[name], c.double()), name


@pytest.mark.parametrize("spec,construct", _REFUSED, ids=[s.name for s, _ in _REFUSED])
def test_a_construct_without_an_if_form_is_refused_by_name(spec, construct):
    with pytest.raises(UnsupportedLayerError, match=construct):
        snnconv.convert(build(spec), _random_batches(spec.size, n=1), T=4, finetune_epochs=0,
                        progress=False)


class _AfterRelu(nn.Module):
    def __init__(self, layer: nn.Module, flat: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.layer, self.flat = layer, flat
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = torch.relu(self.conv(x)).mean((2, 3))
        if self.flat:
            y = self.layer(y.unsqueeze(1), y.unsqueeze(1), y.unsqueeze(1))[0].squeeze(1)
        else:
            y = self.layer(y)
        return self.head(y)


@pytest.mark.parametrize("layer,name,flat", [
    (nn.GELU(), "GELU", False), (nn.SiLU(), "SiLU", False), (nn.Hardswish(), "Hardswish", False),
    (nn.LayerNorm(4), "LayerNorm", False), (nn.MultiheadAttention(4, 1, batch_first=True),
                                            "MultiheadAttention", True)],
    ids=["GELU", "SiLU", "Hardswish", "LayerNorm", "attention"])
def test_layers_without_an_if_form_are_refused_by_name(layer, name, flat):
    with pytest.raises(UnsupportedLayerError, match=name):
        snnconv.convert(_AfterRelu(layer, flat).eval(), _random_batches(8, n=1), T=4,
                        finetune_epochs=0, progress=False)
