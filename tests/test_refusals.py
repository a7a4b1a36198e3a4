"""A model with several constructs that have no IF form is refused once, listing every one of
them by kind, each with its module path (the fx node beside it) and the advice for its kind."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.errors import UnsupportedLayerError


def _batches(shape=(2, 3, 32, 32), classes: int = 10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))
            for _ in range(2)]


def _refusal(model: nn.Module, shape=(2, 3, 32, 32)) -> UnsupportedLayerError:
    with pytest.raises(UnsupportedLayerError) as info:
        snnconv.convert(model, _batches(shape), T=4, finetune_epochs=0, progress=False)
    return info.value


def test_mobilenet_v3_small_is_refused_once_with_every_construct():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10).eval()
    err = _refusal(model)
    text = str(err)
    hardswish = [n for n, m in model.named_modules() if isinstance(m, nn.Hardswish)]
    hardsigmoid = [n for n, m in model.named_modules() if isinstance(m, nn.Hardsigmoid)]
    gates = [n for n, m in model.named_modules() if type(m).__name__ == "SqueezeExcitation"]
    assert len(hardswish) == 19 and len(hardsigmoid) == len(gates) == 9
    kinds = [c.kind for c in err.found]
    assert kinds.count("activation") == 28 and kinds.count("product") == 9 and len(kinds) == 37
    assert text.startswith("37 construct(s) of the model have no integrate-and-fire equivalent (found at "
                           "prepare); all of them, by kind:")
    # every one by its module path, the fx node beside it
    for path in hardswish:
        assert re.search(rf"  - {re.escape(path)}: Hardswish \(fx node '[\w]+'\)", text), path
    for path in hardsigmoid:
        assert f"  - {path}: Hardsigmoid (fx node '" in text
        assert f"the gate of the product in '{path.rsplit('.', 1)[0]}'" in text
    for path in gates:
        assert re.search(rf"  - {re.escape(path)}: 'mul' of two activations \(fx node 'mul(_\d+)?'\)", text)
    # grouped: the activations first, then the products, each group with the advice for its kind
    act, prod = text.index("[activation other than ReLU: 28]"), text.index("[product (or quotient) of two "
                                                                           "activations: 9]")
    assert act < prod
    assert "Replace each with nn.ReLU and fine-tune the ANN" in text[act:prod]
    assert "if isinstance(child, (nn.Hardsigmoid, nn.Hardswish)):" in text[act:prod]
    assert "no IF network computes x * gate(x)" in text[prod:]
    assert "setattr(model.get_submodule(parent), name, nn.Identity())" in text[prod:]
    assert all(f"'{path}'" in text[prod:] for path in gates)


def test_the_advice_given_for_mobilenet_v3_small_converts_it():
    """The two snippets of the refusal, applied as they are printed: nothing is refused after."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10).eval()
    text = str(_refusal(model))
    snippets = re.findall(r"\n((?:      .*\n)+)", text + "\n")
    assert len(snippets) == 2
    for code in snippets:
        exec("\n".join(line[6:] for line in code.splitlines()), {"model": model, "nn": nn})
    assert not any(isinstance(m, (nn.Hardswish, nn.Hardsigmoid)) for m in model.modules())
    from snnconv.activation import unsupported_constructs
    from snnconv.graph import prepare

    assert unsupported_constructs(prepare(model), "avg") == []


def test_efficientnet_b0_is_refused_once_with_every_construct_and_its_stochastic_depth_accepted():
    """With no ReLU at all, the products behind its SiLUs are listed in the same refusal; its
    eval-mode stochastic depth is the identity and not listed."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.efficientnet_b0(weights=None, num_classes=10).eval()
    err = _refusal(model)
    kinds = [c.kind for c in err.found]
    silu = sum(isinstance(m, nn.SiLU) for m in model.modules())
    gates = [n for n, m in model.named_modules() if type(m).__name__ == "SqueezeExcitation"]
    assert kinds.count("activation") == silu + len(gates) == 65
    assert kinds.count("product") == len(gates) == 16 and len(kinds) == 81
    assert "stochastic" not in str(err).lower()
    text = str(err)
    act, prod = text.index("[activation other than ReLU: 65]"), text.index("[product (or quotient) of two "
                                                                           "activations: 16]")
    assert act < prod and all(f"'{path}'" in text[prod:] for path in gates)


class _Residual(nn.Module):
    """A residual block with stochastic depth as torchvision writes it, module and function."""

    def __init__(self):
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.drop = StochasticDepth(0.2, "row")
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        from torchvision.ops import stochastic_depth

        a = F.relu(self.conv1(x))
        b = a + self.drop(F.relu(self.conv2(a)))
        b = b + stochastic_depth(F.relu(self.conv2(b)), 0.1, "batch", self.training)
        return self.head(b.mean((2, 3)))


def test_stochastic_depth_in_eval_mode_is_the_identity():
    pytest.importorskip("torchvision")
    from snnconv.graph import prepare

    model = _Residual().eval()
    gm = prepare(model)
    assert not any("stochastic" in str(n.target) or "drop" in str(n.target) for n in gm.graph.nodes)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(gm(x), model(x))
    snn, _ = snnconv.convert(model, _batches((2, 3, 8, 8)), T=2, finetune_epochs=0, reconstruction_steps=0,
                             progress=False, on_collapse="warn")
    assert snnconv.export_nir(snn) is not None


class _Mixed(nn.Module):
    """A product and a normalisation in the model's own forward, and a GELU module."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        a = F.relu(self.conv1(x))
        b = self.conv2(self.norm(a))
        y = F.relu(b) * torch.relu(b).flip(-1)
        return self.head(self.act(y.mean((2, 3))))


def test_each_kind_gets_its_own_advice_and_a_normalisation_says_where_it_sits():
    err = _refusal(_Mixed().eval(), shape=(2, 3, 8, 8))
    text = str(err)
    assert [c.kind for c in err.found] == ["normalisation", "product", "activation"]
    assert "  - norm: GroupNorm module (fx node 'norm'); sits after the activation at 'relu' (a spiking " \
           "layer), before 'conv2'" in text
    assert "  - the model's forward(): 'mul' of two activations (fx node 'mul'" in text
    assert "A product in the model's own forward(): edit forward() there." in text
    assert "  - act: GELU (fx node 'act')" in text
    assert "Replace it with a BatchNorm (fixed statistics at inference, folded into the layer before it)" in text
