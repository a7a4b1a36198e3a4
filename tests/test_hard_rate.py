"""The hard-reset rate as an activation (``QCFS(hard_T=T)``, ``convert(hard_rate=)``): it is the
rate the reset-to-zero IF neuron really has on a constant input, so a network whose only
neurons read constant (analog) inputs spikes exactly as its ANN computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import snnconv
from snnconv.activation import QCFS, hard_reset_rate, qcfs_sites
from snnconv.errors import ConfigError
from snnconv.snn.neuron import if_step
from snnconv.stages.qcfs import calibrate_qcfs
from snnconv.stages.spiking import to_spiking


def _simulated_rate(x: torch.Tensor, theta: torch.Tensor, T: int) -> torch.Tensor:
    v, n = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(T):
        s, v = if_step(v, x, theta, reset="zero")
        n += s
    return n / T


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 8, 16, 32])
def test_the_staircase_is_the_simulated_neuron_s_rate_on_constant_inputs(T):
    g = torch.Generator().manual_seed(T)
    x = torch.rand(50_000, generator=g) * 1.6 - 0.3
    theta = torch.tensor(0.7)
    assert torch.equal(hard_reset_rate(x / theta, T), _simulated_rate(x, theta, T))


def test_its_levels_are_a_spike_every_p_steps():
    u = torch.tensor([-1.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.99, 1.0, 3.0])
    # p = ceil(1/u): inf, inf, 10, 5, 4, 2, 2, 2, 1, 1; T=8: floor(8/p)/8
    assert hard_reset_rate(u, 8).tolist() == [0, 0, 0, 1 / 8, 2 / 8, 4 / 8, 4 / 8, 4 / 8, 1, 1]


def test_its_gradient_is_straight_through_the_clip_and_reaches_lambda():
    q = QCFS(4, torch.tensor(2.0), hard_T=8)
    x = torch.tensor([-1.0, 0.5, 1.5, 3.0], requires_grad=True)
    q(x).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    # d(lambda * rate(x / lambda)) / d lambda = rate - x / lambda inside (0, lambda), rate outside
    u = x.detach() / 2.0
    expected = (hard_reset_rate(u, 8) - u * ((u > 0) & (u < 1)).float()).sum()
    assert q.lam.grad.item() == pytest.approx(expected.item())


@pytest.mark.parametrize("hard_T", [0, -1, 2.5, True])
def test_a_bad_hard_T_is_refused(hard_T):
    with pytest.raises(ConfigError, match="hard_T"):
        QCFS(4, 1.0, hard_T=hard_T)


@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_one_hidden_layer_spikes_exactly_as_its_staircase_ann(T):
    """The hidden neurons read the analog input, constant over the steps: the SNN's readout (the
    mean over T of a linear layer of their spikes) equals the ANN with the staircase."""
    torch.manual_seed(0)
    ann = nn.Sequential(nn.Flatten(), nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    x = torch.randn(64, 20)
    qann = calibrate_qcfs(ann, [x], L=T, hard_T=T, progress=False)
    assert all(q.hard_T == T for q in qcfs_sites(qann).values())
    snn = to_spiking(qann, T=T, reset="zero")
    with torch.no_grad():
        torch.testing.assert_close(snn(x), qann(x), rtol=1e-5, atol=1e-5)


def test_hard_rate_needs_reset_zero():
    with pytest.raises(ConfigError, match="hard_rate"):
        snnconv.ConvertConfig(reset="subtract", hard_rate=True)


def test_a_reference_at_other_levels_is_the_rate_over_that_many_steps():
    from snnconv.calibration.reference import qcfs_levels

    torch.manual_seed(0)
    ann = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(16, 6)
    at8, at3 = (calibrate_qcfs(ann, [x], L=T, hard_T=T, progress=False) for T in (8, 3))
    at3.get_submodule(next(iter(qcfs_sites(at3)))).lam.data.copy_(next(iter(qcfs_sites(at8).values())).lam)
    with torch.no_grad():
        with qcfs_levels(at8, 3):
            assert torch.equal(at8(x), at3(x))
        assert next(iter(qcfs_sites(at8).values())).hard_T == 8  # restored


def test_a_default_staircase_whose_training_did_not_help_falls_back_to_plain_qcfs(
        small_digits_ann, digits_data, monkeypatch):
    """Where the staircase's training kept nothing (its best epoch is the calibration), the
    default conversion goes on as with hard_rate=False, and says so."""
    from torch.utils.data import DataLoader

    import snnconv.pipeline as pipeline

    real = pipeline.calibrate_qcfs

    def untrained(*args, **kwargs):
        gm = real(*args, **{**kwargs, "train": None} if kwargs.get("hard_T") else kwargs)
        if kwargs.get("hard_T"):
            gm.meta["qcfs"]["best_epoch"] = 0  # as when no epoch beat the calibration
        return gm

    monkeypatch.setattr(pipeline, "calibrate_qcfs", untrained)
    train = DataLoader(digits_data[0], batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="hard-reset rate's training did not beat"):
        _, meta = snnconv.convert(small_digits_ann, train, T=4, reset="zero", finetune_epochs=0,
                                  progress=False, on_collapse="warn")
    qcfs = {s.name: s.changes for s in meta.stages}["qcfs"]
    assert "hard_rate_fallback" in qcfs and qcfs["hard_T"] is None and "history" not in qcfs
