"""Stage 0, prepare: an eval-mode traced copy; the caller's model is never changed."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import snnconv
from snnconv import models
from snnconv.errors import FoldError, UnsupportedModelError
from snnconv.graph import prepare


def _snapshot(model: nn.Module) -> tuple[dict[str, bytes], dict[str, bool], dict[str, bool]]:
    state = {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}
    flags = {name: m.training for name, m in model.named_modules()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    return state, flags, grads


class _ReluThenBN(nn.Module):
    """conv -> ReLU -> BN(y + y): prepare succeeds, the fold stage refuses (no single layer can
    absorb a BatchNorm of a value added to itself)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU(inplace=True)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 2))

    def forward(self, x):
        y = self.relu(self.conv(x))
        return self.head(self.bn(y + y))


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.conv(x)
        return -self.conv(x)


def test_prepare_returns_an_eval_mode_traced_copy_computing_the_same_function():
    torch.manual_seed(0)
    model = models.get("resnet8").train()
    gm = prepare(model)
    assert isinstance(gm, fx.GraphModule)
    assert not any(m.training for m in gm.modules())
    assert model.training  # the caller's flag is untouched
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model.eval()(x)
        assert torch.equal(gm(x), ref)


def test_prepare_shares_no_tensor_with_the_caller_model():
    model = models.get("small_cnn")
    gm = prepare(model)
    theirs = {t.data_ptr() for t in model.state_dict().values()}
    ours = {t.data_ptr() for t in gm.state_dict().values()}
    assert not theirs & ours
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(1.0)
    for name, p in gm.named_parameters():
        assert torch.equal(model.get_parameter(name), before[name])
        assert not torch.equal(p, before[name])


@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_a_failing_fold_leaves_the_caller_model_bit_identical(mode):
    torch.manual_seed(0)
    model = _ReluThenBN()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    model.train(mode != "eval")
    if mode == "mixed":
        model.bn.eval()
        model.head.eval()
    before = _snapshot(model)
    with pytest.raises(FoldError):
        snnconv.fold_batchnorm(model, example_input=torch.randn(2, 3, 6, 6))
    assert _snapshot(model) == before


def test_a_successful_fold_leaves_the_caller_model_bit_identical():
    model = models.get("resnet8").train()
    before = _snapshot(model)
    snnconv.fold_batchnorm(model, example_input=torch.randn(2, 3, 32, 32))
    assert _snapshot(model) == before


def test_untraceable_model_is_refused_naming_the_construct_and_the_fix():
    model = _DataDependent()
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError) as info:
        prepare(model)
    message = str(info.value)
    assert "_DataDependent" in message
    assert "if x.sum() > 0:" in message  # the offending line of the user's forward
    assert "control flow" in message
    assert "torch.fx.wrap" in message or "Move such logic out of forward()" in message
    assert _snapshot(model) == before


def test_fold_of_an_untraceable_model_raises_unsupported_model_error():
    with pytest.raises(UnsupportedModelError):
        snnconv.fold_batchnorm(_DataDependent())


def test_prepare_refuses_what_is_not_a_module():
    with pytest.raises(UnsupportedModelError, match=r"expected a torch\.nn\.Module"):
        prepare(lambda x: x)


def test_prepare_refuses_a_model_that_cannot_be_copied():
    model = nn.Sequential(nn.Linear(2, 2))
    model.lock = threading.Lock()  # not deep-copyable
    with pytest.raises(UnsupportedModelError, match="deep-copy"):
        prepare(model)
    assert model.training
