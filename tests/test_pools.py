"""Poolings NIR has no node for are written exactly with nodes it has: an adaptive pool with
uneven windows folds into its Linear, a ceil-mode pool becomes a sum convolution and a
per-position scale; the exported graph runs on the cpu backend bit-identically to the torch SNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.backends import get
from snnconv.constructs.pools import ceil_pool_parts, fold_adaptive_pools, rewrite_ceil_pools
from snnconv.constructs.prefix import analog_prefix
from snnconv.graph import prepare
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import Scale


def _same_on_cpu(snn, x, T=4):
    """The exported graph on the cpu backend against the torch SNN: outputs and spike counts."""
    graph = snnconv.export_nir(snn)
    stem = analog_prefix(snn)
    with torch.no_grad():
        ref, counts = snn.run(x, T, spike_counts=True)
        result = get("cpu").compile(graph).run(stem(x) if stem is not None else x, T)
    assert torch.equal(result.outputs, ref), (result.outputs - ref).abs().max()
    assert set(result.spikes) == set(counts)
    for name, c in counts.items():
        assert torch.equal(result.spikes[name], c.double()), name
    back = snnconv.from_nir(graph, T=T)  # and the graph reads back into the same network
    with torch.no_grad():
        assert torch.equal(back.run(stem(x) if stem is not None else x, T), ref)
    return graph


@pytest.mark.parametrize("size,out", [((2, 2), (7, 7)), ((5, 3), (3, 2)), ((1, 1), (7, 7)), ((3, 3), (2, 2))])
def test_an_adaptive_pool_that_replicates_or_has_uneven_windows_folds_into_its_linear(size, out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(out),
                          nn.Flatten(), nn.Dropout(), nn.Linear(8 * out[0] * out[1], 5)).eval()
    x = torch.randn(4, 3, *size)
    gm = prepare(model)
    (done,) = fold_adaptive_pools(gm, (x,))
    assert done["in_features"] == [8 * out[0] * out[1], 8 * size[0] * size[1]]
    assert not any(isinstance(m, nn.AdaptiveAvgPool2d) for m in gm.modules())
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-5)


def test_an_adaptive_pool_with_an_avgpool_form_that_shrinks_is_left():
    model = nn.Sequential(nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(), nn.Linear(12, 2)).eval()
    gm = prepare(model)
    assert fold_adaptive_pools(gm, (torch.randn(2, 3, 8, 8),)) == []
    assert sum(isinstance(m, nn.AdaptiveAvgPool2d) for m in gm.modules()) == 1


_CEIL = [dict(kernel_size=3, stride=2), dict(kernel_size=2, stride=2),
         dict(kernel_size=3, stride=2, padding=1),
         dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0)),
         dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
         dict(kernel_size=3, stride=2, divisor_override=2)]


@pytest.mark.parametrize("size", [7, 8, 14, 15])
@pytest.mark.parametrize("kw", _CEIL, ids=[str(sorted(k.items())) for k in _CEIL])
def test_a_ceil_mode_average_pool_is_a_sum_convolution_and_a_per_position_scale(kw, size):
    pool = nn.AvgPool2d(ceil_mode=True, **kw)
    x = torch.rand(3, 4, size, size + 1, dtype=torch.float64)
    conv, scale = ceil_pool_parts(pool, (4, size, size + 1))
    with torch.no_grad():
        got = scale.double()(conv.double()(x))
        assert torch.allclose(got, pool(x), rtol=1e-6, atol=0)  # 1 / divisor in float32
    assert set(conv.weight.unique().tolist()) <= {0.0, 1.0} and conv.groups == 4


def test_only_a_ceil_mode_that_adds_a_window_is_rewritten():
    model = nn.Sequential(nn.AvgPool2d(3, 2, ceil_mode=True)).eval()
    gm = prepare(model)
    assert rewrite_ceil_pools(gm, (torch.randn(2, 3, 16, 16),)) != []
    assert isinstance(gm.get_submodule("0"), nn.Conv2d)
    assert sum(isinstance(m, Scale) for m in gm.modules()) == 1
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-6)


class _CeilNet(nn.Module):
    """A max-pooled stem (the analog prefix with ``maxpool="auto"``), then ceil-mode max- and
    average-pooling between neurons (the first adds a window, the second not), then an
    adaptive pool from 2x2 to 3x3 (uneven windows) before the classifier."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.stem_pool = nn.MaxPool2d(2)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.pool2 = nn.AvgPool2d(2, 2, ceil_mode=True)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d((3, 3)), nn.Flatten(), nn.Linear(72, 5))

    def forward(self, x):  # 16 -> stem 8 -> pool1 4 (floor mode: 3) -> pool2 2 -> adaptive 3x3
        y = self.stem_pool(torch.relu(self.a(x)))
        y = self.pool1(torch.relu(self.b(y)))
        return self.head(self.pool2(torch.relu(self.c(y))))


@pytest.mark.parametrize("maxpool", ["auto", "avg"])
def test_a_network_with_ceil_mode_and_uneven_adaptive_pools_exports_and_runs_bit_identically(maxpool):
    torch.manual_seed(0)
    model = _CeilNet().eval()
    x = torch.randn(4, 3, 16, 16) + 0.5
    snn, meta = snnconv.convert(model, [x], T=4, finetune_epochs=0, maxpool=maxpool,
                                progress=False, on_collapse="warn")
    qcfs = next(r for r in meta.stages if r.name == "qcfs").changes
    assert [d["pool"].split("'")[1] for d in qcfs["ceil_pools"]] == ["pool1"]
    prepare_changes = meta.stages[0].changes["constructs"]
    assert prepare_changes["adaptive_pools"] and "pool2" in prepare_changes["ceil_mode_dropped"]
    _same_on_cpu(snn, x)


def test_a_ceil_mode_average_pool_between_neurons_exports_and_runs_bit_identically(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(),
                          nn.AvgPool2d(3, 2, padding=1, ceil_mode=True),
                          nn.Conv2d(6, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).eval()
    x = torch.randn(4, 3, 12, 12) + 0.5
    assert model[2](torch.zeros(1, 6, 12, 12)).shape[-1] == 7  # a window that floor mode has not
    snn, _ = snnconv.convert(model, [x], T=4, finetune_epochs=0, progress=False, on_collapse="warn")
    graph = _same_on_cpu(snn, x)
    snn.save(tmp_path / "snn.pt")  # the per-position scale travels in the network's file
    with torch.no_grad():
        assert torch.equal(SpikingNetwork.load(tmp_path / "snn.pt").run(x, 4), snn.run(x, 4))
    assert any(type(n).__name__ == "Scale" and n.scale.ndim == 3 and len(set(n.scale.ravel().tolist())) > 1
               for n in graph.nodes.values())
