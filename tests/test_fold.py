"""Stage 1, BatchNorm folding: equivalence on random layers, the zoo, refusals, the add case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _probes import FunctionalBN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.modules.batchnorm import _BatchNorm

import snnconv
from snnconv import models
from snnconv.errors import FoldError
from snnconv.stages.fold import fold_weights

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

# --------------------------------------------------------------------------------------------
# helpers


def _close_enough(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> tuple[bool, float, float]:
    """``max |out - ref| <= rel * max(1, max |ref|)``; also returns both sides for the message."""
    diff = float((out.double() - ref.double()).abs().max())
    bound = rel * max(1.0, float(ref.double().abs().max()))
    return diff <= bound, diff, bound


def _batchnorm_count(model: nn.Module) -> int:
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def _randomise_bn(model: nn.Module, seed: int = 0) -> None:
    """Give every BatchNorm non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                n = m.num_features
                if m.track_running_stats:
                    m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
                    m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
                if m.affine:
                    m.weight.copy_(0.5 + torch.rand(n, generator=g))
                    m.bias.copy_(0.1 * torch.randn(n, generator=g))


def _snapshot(model: nn.Module) -> tuple[dict[str, bytes], dict[str, bool]]:
    state = {k: v.detach().cpu().numpy().tobytes() for k, v in model.state_dict().items()}
    flags = {name: m.training for name, m in model.named_modules()}
    return state, flags


# --------------------------------------------------------------------------------------------
# property: a random producer followed by a random BatchNorm folds to the same function

_BN_TYPES = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_CONV_TYPES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@st.composite
def producer_bn_cases(draw):
    """A (model, input) pair: Conv1d/2d/3d or Linear, then a BatchNorm with random statistics."""
    dims = draw(st.sampled_from([0, 1, 2, 3]))  # 0: Linear
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    bias = draw(st.booleans())
    if dims == 0:
        cin, cout = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        producer: nn.Module = nn.Linear(cin, cout, bias=bias)
        x_shape: tuple[int, ...] = (draw(st.integers(1, 4)), cin)
    else:
        depthwise = draw(st.booleans())
        if depthwise:
            cin = draw(st.integers(1, 6))
            groups, cout = cin, cin * draw(st.integers(1, 3))
        else:
            groups = draw(st.integers(1, 3))
            cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
        kernel = draw(st.integers(1, 3))
        dilation = draw(st.integers(1, 2))
        padding = draw(st.integers(0, 2))
        padding_mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
        producer = _CONV_TYPES[dims](
            cin, cout, kernel, stride=draw(st.integers(1, 2)), padding=padding, dilation=dilation,
            groups=groups, bias=bias, padding_mode=padding_mode)
        size = 7 if dims < 3 else 5
        x_shape = (draw(st.integers(1, 3)), cin) + (size,) * dims
    with torch.no_grad():
        producer.weight.copy_(torch.randn(producer.weight.shape, generator=g))
        if bias:
            producer.bias.copy_(torch.randn(cout, generator=g))

    affine = draw(st.booleans())
    eps = draw(st.sampled_from([1e-5, 1e-3, 1e-8, 0.1, 1.0]))
    sync = draw(st.booleans())
    bn_type = nn.SyncBatchNorm if sync else _BN_TYPES[max(dims, 1)]
    bn = bn_type(cout, eps=eps, affine=affine)
    var_scale = draw(st.sampled_from([1e-8, 1e-4, 1.0, 100.0]))
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(cout, generator=g) * draw(st.sampled_from([0.0, 1.0, 5.0])))
        var = var_scale * (0.1 + torch.rand(cout, generator=g))
        if draw(st.booleans()):  # some channels with a tiny variance
            var[torch.rand(cout, generator=g) < 0.5] = 1e-8
        bn.running_var.copy_(var)
        if affine:
            bn.weight.copy_(torch.randn(cout, generator=g))
            bn.bias.copy_(torch.randn(cout, generator=g))
    model = nn.Sequential(producer, bn)
    model.train(draw(st.booleans()))  # folding must use running stats whatever the mode
    x = torch.randn(x_shape, generator=g) * draw(st.sampled_from([1.0, 10.0]))
    return model, x


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(producer_bn_cases())
def test_fold_random_producer_and_batchnorm_keeps_eval_output(case):
    model, x = case
    with torch.no_grad():
        ref = copy.deepcopy(model).eval()(x)
    folded = snnconv.fold_batchnorm(model)
    with torch.no_grad():
        out = folded(x)
    assert out.shape == ref.shape
    ok, diff, bound = _close_enough(out, ref)
    assert ok, f"max abs diff {diff:.3g} > {bound:.3g} for {model}"
    assert _batchnorm_count(folded) == 0
    assert snnconv.find_batchnorm(folded) == []
    params = list(folded.parameters())
    assert params, "the folded producer lost its parameters"
    for p in params:
        assert p.dtype == torch.float32
        assert p.requires_grad


def test_sync_batchnorm_in_eval_mode_is_the_batchnorm_affine_map():
    # The property test compares against SyncBatchNorm's own eval forward; pin that it is the
    # running-statistics affine map on CPU, without a process group.
    torch.manual_seed(0)
    bn = nn.SyncBatchNorm(5, eps=1e-3).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.1, 3.0)
        bn.weight.normal_()
        bn.bias.normal_()
    x = torch.randn(4, 5, 3, 3, dtype=torch.float64)
    bn = bn.double()
    shape = (1, -1, 1, 1)
    expected = ((x - bn.running_mean.view(shape)) / torch.sqrt(bn.running_var.view(shape) + bn.eps)
                * bn.weight.view(shape) + bn.bias.view(shape))
    with torch.no_grad():
        torch.testing.assert_close(bn(x), expected, rtol=1e-12, atol=1e-12)


def test_folded_bias_is_trainable_even_when_the_conv_had_none():
    # torch.nn.utils.fusion.fuse_conv_bn_eval leaves such a bias with requires_grad=False
    model = nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3))
    _randomise_bn(model)
    folded = snnconv.fold_batchnorm(model)
    conv = folded.get_submodule("0")
    assert isinstance(conv.bias, nn.Parameter)
    assert conv.bias.requires_grad and conv.weight.requires_grad
    x = torch.randn(2, 2, 5, 5)
    folded(x).sum().backward()
    assert conv.bias.grad is not None and conv.weight.grad is not None


def test_fold_keeps_float64_models_in_float64():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    _randomise_bn(model)
    folded = snnconv.fold_batchnorm(model)
    assert all(p.dtype == torch.float64 for p in folded.parameters())
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model.eval()(x), rtol=1e-12, atol=1e-12)


def test_fold_weights_keeps_the_device_of_a_bias_free_weight():
    weight = torch.randn(4, 3, device="meta")
    stats = torch.zeros(4, device="meta"), torch.ones(4, device="meta")
    w, b = fold_weights(weight, None, *stats, 1e-5, None, None)
    assert w.device.type == "meta" and b.device.type == "meta"
    assert w.shape == (4, 3) and b.shape == (4,)


def test_fold_weights_matches_the_formula_with_non_default_values():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(3, 2, generator=g), torch.randn(3, generator=g)
    mean, var = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5
    gamma, beta = torch.randn(3, generator=g), torch.randn(3, generator=g)
    eps = 0.25
    w2, b2 = fold_weights(w, b, mean, var, eps, gamma, beta)
    s = gamma / torch.sqrt(var + eps)
    torch.testing.assert_close(w2, w * s[:, None])
    torch.testing.assert_close(b2, (b - mean) * s + beta)
    # without the shift (the second addend of a folded add) only the scale applies
    w3, b3 = fold_weights(w, b, mean, var, eps, gamma, beta, add_shift=False)
    torch.testing.assert_close(w3, w * s[:, None])
    torch.testing.assert_close(b3, b * s)


# --------------------------------------------------------------------------------------------
# the zoo

_ZOO_INPUT = {"small_cnn": (4, 3, 8, 8), "resnet18": (2, 3, 32, 32), "vgg16": (2, 3, 32, 32)}


@pytest.mark.parametrize("name", models.names())
def test_zoo_model_folds_without_batchnorm_and_leaves_the_caller_model_untouched(name):
    torch.manual_seed(0)
    model = models.get(name, num_classes=10, in_channels=3)
    _randomise_bn(model, seed=1)
    model.train()  # folding must use the running statistics, not batch statistics
    first_bn = next(m for m in model.modules() if isinstance(m, _BatchNorm))
    first_bn.eval()  # mixed flags must survive too
    before = _snapshot(model)
    x = torch.randn(_ZOO_INPUT.get(name, (4, 3, 32, 32)), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = copy.deepcopy(model).eval()(x)

    folded = snnconv.fold_batchnorm(model, example_input=x)

    assert _batchnorm_count(folded) == 0
    assert snnconv.find_batchnorm(folded) == []
    assert not folded.training
    with torch.no_grad():
        out = folded(x)
    ok, diff, bound = _close_enough(out, ref)
    assert ok, f"{name}: max abs diff {diff:.3g} > {bound:.3g}"
    records = folded.meta["folded"]
    assert len(records) == _batchnorm_count(model)
    for rec in records:  # float32 rounding of activations up to O(10)
        assert rec["max_abs_diff"] is not None and rec["max_abs_diff"] < 1e-4, rec
    after = _snapshot(model)
    assert after[1] == before[1], "training flags of the caller's model changed"
    assert after[0].keys() == before[0].keys()
    for key in before[0]:
        assert after[0][key] == before[0][key], f"{key} of the caller's model changed"


def test_small_cnn_folds_on_28x28_inputs_too():
    model = models.get("small_cnn", num_classes=10, in_channels=1)
    _randomise_bn(model)
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.eval()(x)
        out = snnconv.fold_batchnorm(model)(x)
    ok, diff, bound = _close_enough(out, ref)
    assert ok, f"max abs diff {diff:.3g} > {bound:.3g}"


def test_model_without_batchnorm_passes_through_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    before = _snapshot(model)
    folded = snnconv.fold_batchnorm(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(folded(x), model(x))
    assert folded.meta["folded"] == []
    assert {k: v.detach().numpy().tobytes() for k, v in folded.state_dict().items()} == before[0]
    assert _snapshot(model) == before


# --------------------------------------------------------------------------------------------
# refusals: each names the BatchNorm


class _ConvThenBN(nn.Module):
    """``conv`` (3x3, to 4 channels) and ``the_bn``; each subclass says how they are wired."""

    channels_in, padding, track_running_stats = 3, 0, True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(self.channels_in, 4, 3, padding=self.padding)
        self.the_bn = nn.BatchNorm2d(4, track_running_stats=self.track_running_stats)


class _TwoConvsThenBN(nn.Module):
    """``c1`` and ``c2`` (3x3, from 3 channels to ``channels_out`` each) and ``the_bn``."""

    channels_out = 4

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, self.channels_out, 3)
        self.c2 = nn.Conv2d(3, self.channels_out, 3)
        self.the_bn = nn.BatchNorm2d(4)


class _NoRunningStats(_ConvThenBN):
    track_running_stats = False

    def forward(self, x):
        return self.the_bn(self.conv(x))


class _ProducerFeedsTwo(_ConvThenBN):
    def forward(self, x):
        y = self.conv(x)
        return self.the_bn(y) + y


class _AddWithInput(_ConvThenBN):
    """BN(conv(x) + x): the identity addend has no producer."""

    channels_in, padding = 4, 1

    def forward(self, x):
        return self.the_bn(self.conv(x) + x)


class _AddWithSharedAddend(_TwoConvsThenBN):
    """BN(c1(x) + c2(x)) where c1's output also feeds the result."""

    def forward(self, x):
        a = self.c1(x)
        return self.the_bn(a + self.c2(x)) * a


class _AddWithActivatedAddend(_TwoConvsThenBN):
    """BN(relu(c1(x)) + c2(x))."""

    def forward(self, x):
        return self.the_bn(F.relu(self.c1(x)) + self.c2(x))


class _AddOfTheSameValue(_ConvThenBN):
    """BN(y + y): one producer, added to itself."""

    def forward(self, x):
        y = self.conv(x)
        return self.the_bn(y + y)


class _ReluBeforeBN(_ConvThenBN):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        if self.kind == "module":
            y = self.relu(y)
        elif self.kind == "function":
            y = F.relu(y)
        else:
            y = y.relu()
        return self.the_bn(y)


class _CatBeforeBN(_TwoConvsThenBN):
    channels_out = 2

    def forward(self, x):
        return self.the_bn(torch.cat([self.c1(x), self.c2(x)], dim=1))


class _BNAtInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.the_bn = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.the_bn(x))


class _SharedProducer(_ConvThenBN):
    """One conv module called at two places, one of them feeding the BatchNorm."""

    channels_in, padding = 4, 1

    def forward(self, x):
        return self.the_bn(self.conv(x)) + self.conv(x)


class _LinearBN2d(nn.Module):
    """Linear on a 4-d tensor then BatchNorm2d: the BN normalises dim 1, not the features."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.the_bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.the_bn(self.fc(x))


_REFUSALS = {
    "no running stats": (_NoRunningStats, "track_running_stats"),
    "add of the same value twice": (_AddOfTheSameValue, "more than once"),
    "Linear then BatchNorm2d": (_LinearBN2d, "Linear"),
}

#: BatchNorms no convolution can absorb: each is an affine map of its own ("affine"), or folds
#: into the unpadded layer after it ("consumer").
_AFFINES = {
    "producer feeds the BN and another user": (_ProducerFeedsTwo, "affine"),
    "add with the model input": (_AddWithInput, "affine"),
    "add with a multi-use addend": (_AddWithSharedAddend, "affine"),
    "add with an activated addend": (_AddWithActivatedAddend, "affine"),
    "ReLU module before BN": (lambda: _ReluBeforeBN("module"), "affine"),
    "F.relu before BN": (lambda: _ReluBeforeBN("function"), "affine"),
    "Tensor.relu before BN": (lambda: _ReluBeforeBN("method"), "affine"),
    "torch.cat before BN": (_CatBeforeBN, "affine"),
    "BN at the model input, unpadded conv after": (_BNAtInput, "consumer"),
    "producer called twice": (_SharedProducer, "affine"),
}


@pytest.mark.parametrize("case", list(_REFUSALS), ids=list(_REFUSALS))
def test_unfoldable_batchnorm_is_refused_with_its_name(case):
    factory, reason = _REFUSALS[case]
    model = factory()
    _randomise_bn(model)
    with pytest.raises(FoldError) as info:
        snnconv.fold_batchnorm(model)
    message = str(info.value)
    assert "'the_bn'" in message, message
    assert reason in message, message


@pytest.mark.parametrize("case", list(_AFFINES), ids=list(_AFFINES))
def test_batchnorm_without_a_producer_becomes_a_per_channel_affine(case):
    factory, kind = _AFFINES[case]
    model = factory().eval()
    _randomise_bn(model)
    before = _snapshot(model)
    x = torch.randn(3, getattr(model, "channels_in", 3), 8, 8)
    folded = snnconv.fold_batchnorm(model, example_input=x)
    snnconv.assert_no_batchnorm(folded)
    (pair,) = folded.meta["folded"]
    assert pair["batchnorm"] == "the_bn" and pair["kind"] == kind, pair
    with torch.no_grad():
        ok, diff, bound = _close_enough(folded(x), model(x))
    assert ok, (diff, bound)
    assert _snapshot(model) == before


def test_batchnorm_before_a_padded_conv_stays_an_affine_layer():
    # folding the shift into a padded conv would turn the padded zeros into the shift
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3, padding=1)).eval()
    _randomise_bn(model)
    x = torch.randn(2, 3, 6, 6)
    folded = snnconv.fold_batchnorm(model, example_input=x)
    assert [p["kind"] for p in folded.meta["folded"]] == ["affine"]
    with torch.no_grad():
        ok, diff, bound = _close_enough(folded(x), model(x))
    assert ok, (diff, bound)


def test_functional_batch_norm_is_refused_naming_the_call():
    with pytest.raises(FoldError) as info:
        snnconv.fold_batchnorm(FunctionalBN())
    message = str(info.value)
    assert "batch_norm" in message and "functional" in message, message
    assert "nn.BatchNorm" in message, message  # says what to do


def test_relu_then_batchnorm_is_not_folded_across_the_relu():
    # the tempting wrong fold (into the conv) changes the function: the conv keeps its weights
    model = _ReluBeforeBN("module")
    _randomise_bn(model)
    folded = snnconv.fold_batchnorm(model)
    assert torch.equal(folded.conv.weight, model.conv.weight)
    assert folded.meta["folded"][0]["kind"] == "affine"


def test_linear_on_a_3d_tensor_is_refused_when_an_example_shows_it():
    # BatchNorm1d on [N, L, F] normalises L; the Linear's features are F (here L == F).
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    _randomise_bn(model)
    with pytest.raises(FoldError) as info:
        snnconv.fold_batchnorm(model, example_input=torch.randn(3, 4, 5))
    assert "'1'" in str(info.value) and "3-d" in str(info.value)
    # the same pair on [N, F] folds
    x = torch.randn(3, 5)
    folded = snnconv.fold_batchnorm(model, example_input=x)
    with torch.no_grad():
        ok, diff, _ = _close_enough(folded(x), model.eval()(x))
    assert ok, diff


# --------------------------------------------------------------------------------------------
# the stretch case: BN after an add of two single-use convs folds into both


class _AddOfTwoConvs(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(3, 4, 1, bias=False)
        self.the_bn = nn.BatchNorm2d(4)

    def forward(self, x):
        a, b = self.c1(x), self.c2(x)
        return self.the_bn(a + b if self.op == "+" else torch.add(a, b))


@pytest.mark.parametrize("op", ["+", "torch.add"])
def test_batchnorm_after_an_add_of_two_single_use_convs_folds_into_both(op):
    torch.manual_seed(0)
    model = _AddOfTwoConvs(op)
    _randomise_bn(model, seed=5)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = model.eval()(x)
    folded = snnconv.fold_batchnorm(model, example_input=x)
    with torch.no_grad():
        out = folded(x)
    ok, diff, bound = _close_enough(out, ref)
    assert ok, f"max abs diff {diff:.3g} > {bound:.3g}"
    assert _batchnorm_count(folded) == 0
    (record,) = folded.meta["folded"]
    assert record["batchnorm"] == "the_bn"
    assert sorted(record["producers"]) == ["c1", "c2"]
    assert record["max_abs_diff"] < 1e-5


def test_batchnorm_after_an_add_of_two_linears_folds_into_both():
    class AddLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.f1, self.f2, self.bn = nn.Linear(3, 5), nn.Linear(2, 5), nn.BatchNorm1d(5, affine=False)

        def forward(self, x, y):
            return self.bn(self.f1(x) + self.f2(y))

    model = AddLinear()
    _randomise_bn(model)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with torch.no_grad():
        ref = model.eval()(x, y)
        out = snnconv.fold_batchnorm(model)(x, y)
    ok, diff, _ = _close_enough(out, ref)
    assert ok, diff


# --------------------------------------------------------------------------------------------
# subclasses are matched by isinstance, never skipped by exact-type matching


class _MyConv(nn.Conv2d):
    """A user subclass that keeps Conv2d's forward."""


class _MyBatchNorm(nn.BatchNorm2d):
    """A user subclass that keeps BatchNorm2d's forward."""


class _DoublingConv(nn.Conv2d):
    """A user subclass that changes forward: not a plain convolution any more."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_subclasses_of_conv_and_batchnorm_fold():
    model = nn.Sequential(_MyConv(3, 4, 3), _MyBatchNorm(4))
    _randomise_bn(model)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = model.eval()(x)
        folded = snnconv.fold_batchnorm(model)
        out = folded(x)
    assert _batchnorm_count(folded) == 0
    ok, diff, _ = _close_enough(out, ref)
    assert ok, diff


def test_a_conv_subclass_with_its_own_forward_is_not_folded_into():
    model = nn.Sequential(_DoublingConv(3, 4, 3), _MyBatchNorm(4))
    _randomise_bn(model)
    x = torch.randn(2, 3, 6, 6)
    folded = snnconv.fold_batchnorm(model, example_input=x)
    assert [p["kind"] for p in folded.meta["folded"]] == ["affine"]  # the conv is left alone
    with torch.no_grad():
        ok, diff, _ = _close_enough(folded(x), model.eval()(x))
    assert ok, diff


def test_a_native_batch_norm_call_is_refused_too():
    class Native(FunctionalBN):
        def forward(self, x):
            return torch.native_batch_norm(self.conv(x), None, None, self.mean, self.var,
                                           False, 0.1, 1e-5)[0]

    with pytest.raises(FoldError, match="native_batch_norm"):
        snnconv.fold_batchnorm(Native())
