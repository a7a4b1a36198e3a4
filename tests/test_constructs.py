"""The constructs rewrites: clipped ReLUs, spatial means, pooling, the static analog prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.activation import qcfs_sites
from snnconv.backends import get
from snnconv.constructs.clip import CappedReLU, rewrite_clips
from snnconv.constructs.means import rewrite_means
from snnconv.constructs.pools import drop_idle_ceil_mode, fold_adaptive_pools
from snnconv.constructs.prefix import AnalogPrefix, analog_prefix, split_prefix
from snnconv.errors import UnsupportedLayerError
from snnconv.graph import prepare
from snnconv.stages.prepare import rewrite_constructs
from snnconv.stages.qcfs import calibrate_qcfs


class _Clipped(nn.Module):
    def __init__(self, kind: str, cap: float = 6.0):
        super().__init__()
        self.kind, self.cap = kind, cap
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU6() if kind == "ReLU6" else nn.Hardtanh(0.0, cap)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(x) * 5  # pre-activations well above the cap
        if self.kind in ("ReLU6", "Hardtanh"):
            y = self.act(y)
        elif self.kind == "F.relu6":
            y = F.relu6(y)
        elif self.kind == "torch.clamp":
            y = torch.clamp(y, 0, self.cap)
        else:
            y = y.clamp(min=0, max=self.cap)
        return self.head(y.mean((2, 3)))


_CLIPS = {"ReLU6": 6.0, "Hardtanh": 2.5, "F.relu6": 6.0, "torch.clamp": 3.0, "Tensor.clamp": 1.5}


@pytest.mark.parametrize("kind", list(_CLIPS))
def test_a_clip_at_zero_and_a_becomes_a_relu_site_whose_lambda_is_at_most_a(kind):
    torch.manual_seed(0)
    model = _Clipped(kind, _CLIPS[kind]).eval()
    x = torch.randn(16, 3, 8, 8)
    gm = prepare(model)
    done = rewrite_clips(gm)
    assert [d.cap for d in done] == [_CLIPS[kind]]
    assert any(isinstance(m, CappedReLU) for m in gm.modules())
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    q = calibrate_qcfs(gm, [x], L=64, percentile=100.0, per_channel=True, progress=False)
    (site,) = qcfs_sites(q).values()
    assert float(site.lam.detach().max()) <= _CLIPS[kind]
    # the saturated channels clip exactly at the cap: QCFS at lambda = a, L levels, is within a/L
    with torch.no_grad():
        assert (q(x) - model(x)).abs().max() <= 2 * _CLIPS[kind] / 64 * model.head.weight.abs().sum()


def test_a_converted_clip_reaches_the_clipped_network_as_t_grows():
    torch.manual_seed(0)
    model = _Clipped("ReLU6").eval()
    x = torch.randn(16, 3, 8, 8)
    snn, _ = snnconv.convert(model, [x], T=8, finetune_epochs=0, bias_calibration=False,
                             percentile=100.0, progress=False)
    assert all(float(t.max()) <= 6.0 for t in snn.thresholds().values())
    with torch.no_grad():
        ref = model(x)
        errs = [float((snn.run(x, T).mean(0) - ref).abs().mean()) for T in (8, 64)]
    assert errs[1] < errs[0]


def test_other_clips_stay_refused_by_name():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Hardtanh(-1.0, 1.0), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(4, 3, 6, 6)
    model(x)
    with pytest.raises(UnsupportedLayerError, match="Hardtanh"):
        snnconv.convert(model.eval(), [x], T=4, finetune_epochs=0, progress=False)


class _Means(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = F.relu(self.conv(x))
        return self.head(y.mean([2, 3])) + torch.mean(y, dim=(-2, -1), keepdim=True).flatten(1)[:, :2] \
            + y.mean(1).flatten(1)[:, :2]


def test_a_spatial_mean_becomes_average_pooling_and_a_channel_mean_is_left():
    model = _Means().eval()
    x = torch.randn(3, 3, 7, 7)
    gm = prepare(model)
    done = rewrite_means(gm, (x,))
    assert len(done) == 2  # the two spatial means, not the one over the channels
    assert sum(isinstance(m, nn.AdaptiveAvgPool2d) for m in gm.modules()) == 2
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-6)


def test_a_pool_that_replicates_a_1x1_map_folds_into_its_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 4), nn.ReLU(), nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(),
                          nn.Linear(8 * 49, 5)).eval()
    x = torch.randn(4, 3, 4, 4)
    gm = prepare(model)
    done = fold_adaptive_pools(gm, (x,))
    assert done and done[0]["in_features"] == [8 * 49, 8]
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-5)
    # at a size where the pool averages, nothing changes
    gm = prepare(model)
    assert fold_adaptive_pools(gm, (torch.randn(2, 3, 17, 17),)) == []


@pytest.mark.parametrize("size,idle", [(15, True), (16, False)])
def test_ceil_mode_is_dropped_only_where_it_changes_nothing(size, idle):
    model = nn.Sequential(nn.MaxPool2d(3, 2, ceil_mode=True)).eval()
    x = torch.randn(2, 3, size, size)
    gm = prepare(model)
    assert bool(drop_idle_ceil_mode(gm, (x,))) == idle
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


class _Stem(nn.Module):
    """A torchvision-ResNet-like stem (conv, BN, ReLU, max-pooling) and a residual block."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 5, stride=2, padding=2, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.pool2 = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.b(F.relu(self.a(x))) + x)
        return self.fc(torch.flatten(self.gap(self.pool2(x)), 1))


def _stem_model():
    torch.manual_seed(0)
    model = _Stem()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16))
    return model.eval()


def test_the_analog_prefix_ends_at_the_first_maxpool_that_sees_only_the_input():
    model = _stem_model()
    x = torch.randn(4, 3, 16, 16)
    gm = prepare(model)
    report = split_prefix(gm)
    assert "maxpool" in report["ends_at"] and len(report["nodes"]) == 4
    assert isinstance(gm.analog_prefix, AnalogPrefix)
    assert "pool2" in dict(gm.named_modules())  # a later max-pooling stays in the network
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


def test_no_prefix_where_a_stem_value_is_read_after_the_cut():
    class Leaky(_Stem):
        def forward(self, x):
            y = self.relu(self.conv1(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.maxpool(y), 1) + y.mean(), 1))

    report = split_prefix(prepare(Leaky().eval()))
    assert report["nodes"] == [] and "also read" in report["why"]


def test_the_prefix_runs_once_in_analog_and_nir_starts_after_it():
    model = _stem_model()
    x = torch.randn(4, 3, 16, 16)
    snn, meta = snnconv.convert(model, [x, x + 0.1], T=4, finetune_epochs=0, progress=False,
                                on_collapse="warn")
    stem = analog_prefix(snn)
    assert stem is not None
    assert meta.settings["maxpool"] == "auto"
    assert meta.stages[0].changes["constructs"]["prefix"]["folded"][0]["batchnorm"] == "bn1"
    snnconv.assert_no_batchnorm(snn)
    # the stem is exact: its output is the ANN's, and the first IF layer sees it at every step
    with torch.no_grad():
        assert torch.allclose(stem(x), model.maxpool(model.relu(model.bn1(model.conv1(x)))), atol=1e-5)
    graph = snnconv.export_nir(snn)
    assert graph.metadata["input"] == "analog_prefix"
    assert tuple(graph.nodes["input"].input_type["input"]) == (8, 4, 4)
    with torch.no_grad():
        ref, counts = snn.run(x, 4, spike_counts=True)
    result = get("cpu").compile(graph).run(stem(x), 4)
    assert torch.equal(result.outputs, ref)
    assert all(torch.equal(result.spikes[k], c.double()) for k, c in counts.items())


def test_maxpool_avg_and_error_keep_their_meaning():
    model = _stem_model()
    x = torch.randn(4, 3, 16, 16)
    snn, _ = snnconv.convert(model, [x], T=4, finetune_epochs=0, maxpool="avg", progress=False,
                             on_collapse="warn")
    assert analog_prefix(snn) is None
    with pytest.raises(UnsupportedLayerError, match="max-pooling"):
        snnconv.convert(model, [x], T=4, finetune_epochs=0, maxpool="error", progress=False)
    with pytest.raises(ValueError, match="maxpool"):
        rewrite_constructs(prepare(model), (x,), maxpool="max")


class _Shuffle(nn.Module):
    """ShuffleNet's channel shuffle and chunk, and a contiguous() that moves nothing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 1)
        self.b = nn.Conv2d(3, 6, 1)
        self.c = nn.Conv2d(9, 4, 1)

    def forward(self, x):
        y = F.relu(self.a(x)).contiguous()
        x1, x2 = y.chunk(2, dim=1)
        z = torch.cat((x1, F.relu(self.b(x))[:, :3], x2), 1)
        n, c, h, w = z.size()
        z = z.view(n, 3, c // 3, h, w).transpose(1, 2).contiguous().view(n, -1, h, w)
        return self.c(z).contiguous().mean((2, 3))


def test_channel_shuffles_and_chunks_become_one_hot_convolutions_bit_for_bit():
    from snnconv.constructs.channels import rewrite_channel_moves

    torch.manual_seed(0)
    model = _Shuffle().eval()
    x = torch.randn(2, 3, 5, 5)
    gm = prepare(model)
    done = rewrite_channel_moves(gm, (x,))
    assert {d["channels"] == "identity" for d in done} == {True, False}
    assert not any(n.target in ("view", "chunk", "transpose") for n in gm.graph.nodes)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


class _ViewFlatten(nn.Module):
    """Flattening by shape arithmetic, as many hand-written VGGs and LeNets do."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        y = F.avg_pool2d(F.relu(self.a(x)), 2)
        if self.form == "view":
            y = y.view(y.size(0), -1)
        elif self.form == "reshape":
            y = y.reshape(y.shape[0], -1)
        else:  # every size named: still a flatten
            n, c, h, w = y.size()
            y = y.view(n, c * h * w)
        return self.fc(y)


@pytest.mark.parametrize("form", ["view", "reshape", "sizes"])
def test_a_flatten_by_shape_arithmetic_becomes_flatten_and_exports(form):
    from snnconv.constructs.channels import rewrite_channel_moves

    torch.manual_seed(0)
    model = _ViewFlatten(form).eval()
    x = torch.randn(8, 1, 8, 8)
    gm = prepare(model)
    done = rewrite_channel_moves(gm, (x,))
    assert [d["flatten"] for d in done] == [[4, 4, 4]]
    assert not any(n.target in ("view", "reshape", "size") for n in gm.graph.nodes)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
        assert torch.equal(gm(x[:3]), model(x[:3]))  # for any batch
    snn, _ = snnconv.convert(model, [x], T=4, finetune_epochs=0, progress=False, on_collapse="warn")
    with torch.no_grad():
        ref = snn.run(x, 4)
    assert torch.equal(get("cpu").compile(snnconv.export_nir(snn)).run(x, 4).outputs, ref)


def test_a_view_that_keeps_the_spatial_dimensions_is_no_flatten():
    from snnconv.constructs.channels import rewrite_channel_moves

    class Half(nn.Module):
        def forward(self, x):
            return x.view(x.size(0), 2, -1)  # [B, 2, C*H*W/2]: not a flatten

    gm = prepare(Half())
    assert rewrite_channel_moves(gm, (torch.randn(2, 4, 3, 3),)) == []


def test_a_max_pooling_after_the_whole_feature_extractor_is_no_prefix():
    layers = []
    for _ in range(3):
        layers += [nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(3, 2)).eval()
    report = split_prefix(prepare(model))
    assert report["nodes"] == [] and "3 ReLU sites" in report["why"]


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, (1, 3), padding=(0, 1))  # a non-square kernel
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.a(x)), kernel_size=3, stride=2)
        y = F.avg_pool2d(F.relu(self.b(y)), 3, stride=1, padding=1)
        y = F.max_pool2d(F.relu(self.b(y)), 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, (1, 1)), 1))


def test_functional_pools_become_modules_and_export_bit_identically():
    torch.manual_seed(0)
    model = _Functional().eval()
    x = torch.randn(4, 3, 9, 9)
    gm = prepare(model)
    done = rewrite_means(gm, (x,))
    assert len(done) == 4
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    snn, _ = snnconv.convert(model, [x], T=4, finetune_epochs=0, bias_calibration=False,
                             progress=False, on_collapse="warn")
    stem = analog_prefix(snn)
    assert stem is not None  # the first max-pooling ends the prefix; the second averages
    graph = snnconv.export_nir(snn)
    with torch.no_grad():
        ref = snn.run(x, 4)
    assert torch.equal(get("cpu").compile(graph).run(stem(x), 4).outputs, ref)
