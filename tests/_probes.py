"""Test helpers shared by several test files: a functional-BatchNorm model, state-dict
comparisons, spike recorders (ours and spikingjelly's)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from snnconv.snn.neuron import neurons


class FunctionalBN(nn.Module):
    """A conv followed by ``F.batch_norm`` on buffers: a BatchNorm no module type shows."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.mean, self.var, training=False)


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(a: dict, b: dict) -> None:
    """The two state dicts hold the same keys and bit-identical tensors."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs diff {(a[k] - b[k]).abs().max()})"


def run_with_spikes(snn, x: torch.Tensor, T: int = 8):
    """Per-step readout [T, B, ...] and every IF layer's spikes [T*B, ...], by layer name."""
    spikes = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: spikes.__setitem__(n, o.detach().clone()))
             for n, m in neurons(snn.net).items()]
    try:
        with torch.no_grad():
            out = snn.run(x, T)
    finally:
        for h in hooks:
            h.remove()
    return out, spikes


def spikingjelly_run(path, x: torch.Tensor, T: int, layers):
    """Run spikingjelly's import of ``path`` for T steps: readouts [T, B, ...], spikes by layer."""
    from spikingjelly.activation_based.nir_exchange import import_from_nir

    net = import_from_nir(str(path), dt=1.0)
    spikes = {n: [] for n in layers}
    for n in layers:
        getattr(net, n).register_forward_hook(lambda mod, i, o, n=n: spikes[n].append(o[0].detach()))
    outs, state = [], None
    with torch.no_grad():
        for _ in range(T):
            out, state = net(x, state)  # direct encoding: the same input at every step
            outs.append(out)
    return torch.stack(outs), {n: torch.cat(s) for n, s in spikes.items()}
