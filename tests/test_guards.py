"""The no-BatchNorm guard: find_batchnorm / assert_no_batchnorm catch every form, list all."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _probes import FunctionalBN

import snnconv
from snnconv import models
from snnconv.errors import BatchNormRemainsError


class _Nested(nn.Module):
    """A BatchNorm two containers deep: ModuleDict -> Sequential -> BatchNorm2d."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({
            "stem": nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
            "body": nn.Sequential(nn.Conv2d(4, 4, 3), nn.Sequential(nn.BatchNorm2d(4))),
        })
        self.heads = nn.ModuleList([nn.Identity()])

    def forward(self, x):
        return self.heads[0](self.blocks["body"](self.blocks["stem"](x)))


class _Several(nn.Module):
    """Two BatchNorm modules (one Sync) and one functional batch_norm."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3)
        self.bn_a = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.bn_b = nn.SyncBatchNorm(4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        x = self.bn_b(self.c2(self.bn_a(self.c1(x))))
        return F.batch_norm(x, self.mean, self.var)


class _MyBatchNorm(nn.BatchNorm2d):
    """A user subclass: exact-type matching would miss it."""


@pytest.mark.parametrize("bn_type", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                                     nn.SyncBatchNorm, _MyBatchNorm])
def test_guard_catches_every_batchnorm_module_type(bn_type):
    model = nn.Sequential(nn.Linear(3, 3), bn_type(3))
    found = snnconv.find_batchnorm(model, trace_graph=False)
    assert len(found) == 1
    assert "'1'" in found[0] and bn_type.__name__ in found[0]
    with pytest.raises(BatchNormRemainsError) as info:
        snnconv.assert_no_batchnorm(model)
    assert info.value.offenders == found
    assert "'1'" in str(info.value)


def test_guard_finds_a_batchnorm_hidden_in_nested_containers():
    with pytest.raises(BatchNormRemainsError) as info:
        snnconv.assert_no_batchnorm(_Nested())
    (offender,) = info.value.offenders
    assert "blocks.body.1.0" in offender and "BatchNorm2d" in offender


def test_guard_finds_a_functional_batch_norm_call():
    model = FunctionalBN()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with pytest.raises(BatchNormRemainsError) as info:
        snnconv.assert_no_batchnorm(model)
    (offender,) = info.value.offenders
    assert "batch_norm" in offender and "functional" in offender


def test_guard_finds_a_functional_batch_norm_inside_a_traced_graph():
    gm = fx.symbolic_trace(FunctionalBN())
    assert len(snnconv.find_batchnorm(gm)) == 1
    wrapper = nn.Sequential(gm, nn.ReLU())  # a GraphModule nested in a plain container
    assert len(snnconv.find_batchnorm(wrapper)) == 1


def test_guard_lists_every_offender_at_once_and_quotes_the_stage():
    with pytest.raises(BatchNormRemainsError) as info:
        snnconv.assert_no_batchnorm(_Several(), stage="fold")
    offenders = info.value.offenders
    assert len(offenders) == 3
    assert any("bn_a" in o and "BatchNorm2d" in o for o in offenders)
    assert any("bn_b" in o and "SyncBatchNorm" in o for o in offenders)
    assert any("functional" in o for o in offenders)
    message = str(info.value)
    assert "3 BatchNorm" in message and "after stage 'fold'" in message
    for o in offenders:
        assert o in message


def test_find_batchnorm_without_tracing_sees_modules_only():
    assert len(snnconv.find_batchnorm(_Several(), trace_graph=False)) == 2


def test_guard_on_an_untraceable_model_still_checks_modules_and_warns():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x):
            if x.sum() > 0:
                return self.bn(x)
            return x

    with pytest.warns(UserWarning, match="functional batch_norm calls were not checked"):
        found = snnconv.find_batchnorm(Untraceable())
    assert len(found) == 1 and "'bn'" in found[0]


@pytest.mark.parametrize("model_factory", [
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)),
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.LayerNorm([4, 6, 6])),
    lambda: snnconv.fold_batchnorm(models.get("resnet8")),
    lambda: snnconv.fold_batchnorm(models.get("small_cnn")),
], ids=["plain cnn", "other norms", "folded resnet8", "folded small_cnn"])
def test_guard_passes_on_models_without_batchnorm(model_factory):
    model = model_factory()
    assert snnconv.find_batchnorm(model) == []
    assert snnconv.assert_no_batchnorm(model) is None


def test_guard_does_not_change_the_model_it_checks():
    model = _Several().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    with pytest.raises(BatchNormRemainsError):
        snnconv.assert_no_batchnorm(model)
    assert [m.training for m in model.modules()] == flags
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_guard_traces_a_model_with_a_batchnorm_subclass_without_warning(recwarn):
    model = nn.Sequential(nn.Conv2d(3, 3, 1), _MyBatchNorm(3))
    assert len(snnconv.find_batchnorm(model)) == 1
    assert not [w for w in recwarn if "not checked" in str(w.message)]
