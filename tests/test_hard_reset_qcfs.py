"""QCFS training for hard reset: the ANN learns the rate a hard-reset IF neuron computes, so the
hard-reset SNN at T = L computes the function it was trained for."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.errors import ConfigError
from snnconv.neuron import if_step
from snnconv.qcfs import QCFS, QCFSTrainConfig, calibrate_qcfs, hard_reset_rate, qcfs_sites


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8, 16])
def test_hard_reset_rate_is_the_if_neuron_on_a_constant_input(steps):
    """Multiples of 1/32 (exact in float) from below 0 to above 1, ties with the threshold included."""
    u = torch.arange(-4, 48).float() / 32
    v, count = torch.zeros_like(u), torch.zeros_like(u)
    for _ in range(steps):
        s, v = if_step(v, u, 1.0, reset="zero")
        count += s
    assert torch.equal(hard_reset_rate(u, steps), count / steps)


def test_hard_reset_qcfs_is_lambda_times_the_rate_with_a_straight_through_gradient():
    lam = torch.tensor([0.5, 2.0])
    q = QCFS(8, lam, reset="zero")
    x = (torch.randn(6, 2, 3, 3) * 2).requires_grad_(True)
    out = q(x)
    expected = lam.view(1, 2, 1, 1) * hard_reset_rate(x.detach() / lam.view(1, 2, 1, 1), 8)
    assert torch.allclose(out, expected, atol=1e-6)
    out.sum().backward()
    inside = (x.detach() > 0) & (x.detach() < lam.view(1, 2, 1, 1))
    assert torch.equal(x.grad, inside.float())  # the gradient of lambda * clip(x / lambda, 0, 1)
    assert q.lam.grad is not None and q.lam.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="reset"):
        QCFS(8, 1.0, reset="hard")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("L", [2, 4, 8])
def test_one_hidden_layer_hard_reset_snn_at_T_equal_L_is_its_qcfs_ann(per_channel, L):
    """The only IF layer reads the constant analog input: its rate is the trained function, so
    the SNN's readout equals the QCFS-ANN's output to float rounding."""
    torch.manual_seed(0)
    model = _MLP().eval()
    qgm = calibrate_qcfs(model, _batches(), L=L, reset="zero", per_channel=per_channel,
                         train=QCFSTrainConfig(epochs=1, seed=0, lr=0.01), progress=False)
    assert all(q.reset == "zero" for q in qcfs_sites(qgm).values())
    snn = snnconv.to_spiking(qgm, T=L, reset="zero")
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(snn.run(x, L).mean(0), qgm(x), atol=1e-5)  # readout: mean over T
    with pytest.raises(ConfigError, match="hard-reset"):
        snnconv.to_spiking(qgm, T=L, reset="subtract")


def test_hard_reset_lambda_fits_the_staircase_under_the_percentile():
    """lambda is the percentile times the factor whose staircase fits the clipped ReLU best:
    never above the percentile, and no worse a fit than the percentile itself."""
    torch.manual_seed(0)
    model = _MLP().eval()
    data = _batches()
    soft = calibrate_qcfs(model, data, L=8, progress=False)
    hard = calibrate_qcfs(model, data, L=8, reset="zero", progress=False)
    p, lam = soft.meta["qcfs"]["sites"], hard.meta["qcfs"]["sites"]
    for name in p:
        assert 0 < lam[name]["lambda"] <= p[name]["lambda"] + 1e-6
    z = torch.cat([model.a(x) for x, _ in data]).detach()
    (name,) = p
    pct = torch.tensor(p[name]["lambda"])

    def err(lam_):
        return ((lam_ * hard_reset_rate(z / lam_, 8) - z.clamp(0, float(pct))) ** 2).mean()

    assert err(torch.tensor(lam[name]["lambda"])) <= err(pct)


def test_convert_trains_the_hard_reset_rate_only_for_a_hard_reset_snn(small_digits_ann, digits_data):
    from torch.utils.data import DataLoader

    train_set, _ = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    for reset in ("zero", "subtract"):
        _, meta = snnconv.convert(small_digits_ann, loader, T=4, reset=reset, qcfs_epochs=1,
                                  finetune_epochs=0, progress=False, on_collapse="warn")
        qcfs = next(s for s in meta.stages if s.name == "qcfs")
        assert qcfs.changes["reset"] == reset
    _, meta = snnconv.convert(small_digits_ann, loader, T=4, reset="zero", qcfs_epochs=0,
                              finetune_epochs=0, progress=False, on_collapse="warn")
    assert next(s for s in meta.stages if s.name == "qcfs").changes["reset"] == "subtract"
