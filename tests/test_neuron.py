"""The IF step function defines the neuron: a golden trajectory for each reset, and every torch
path and in-place kernel gives its spikes bit for bit."""

from __future__ import annotations

import pytest
import torch

from snnconv.calibration.membrane import fire, spike_counts
from snnconv.snn.neuron import IFNeuron, channel_view, fire_subtractive_, fire_zero, if_sequence, if_step

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


def test_step_golden_trajectory_subtractive():
    # theta = 2, v0 = 1.  h: 1.5 | 2.0 (= theta: fires, v 0) | 1.0 | 4.0 (fires, v 2) | 1.0 | -1.0
    x = torch.tensor([0.5, 0.5, 1.0, 3.0, -1.0, -2.0])
    v, spikes, membranes = torch.tensor(1.0), [], []
    for xt in x:
        s, v = if_step(v, xt, 2.0)
        spikes.append(float(s))
        membranes.append(float(v))
    assert spikes == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert membranes == [1.5, 0.0, 1.0, 2.0, 1.0, -1.0]


def test_step_golden_trajectory_hard_reset():
    # theta = 2, v0 = 0.  h: 0.5 | 1.0 | 2.0 (= theta: fires, v 0) | 3.0 (fires, v 0: the 1.0
    # above threshold is lost) | -1.0 | 2.0 (fires)
    x = torch.tensor([0.5, 0.5, 1.0, 3.0, -1.0, 3.0])
    v, spikes, membranes = torch.tensor(0.0), [], []
    for xt in x:
        s, v = if_step(v, xt, 2.0, reset="zero")
        spikes.append(float(s))
        membranes.append(float(v))
    assert spikes == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert membranes == [0.5, 1.0, 0.0, 0.0, -1.0, 0.0]


def test_step_refuses_an_unknown_reset():
    with pytest.raises(ValueError, match="reset"):
        if_step(torch.zeros(1), torch.ones(1), 1.0, reset="soft")


def _inputs(g: torch.Generator, T: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``[T, b, ...]`` with exact ties at the threshold 0.5, exact zeros and negative zeros."""
    x = torch.randn(T, 4, *shape, generator=g)
    x[:2] = 0.5
    x[2, :1] = 0.0
    x[3, :1] = -0.0
    return x


def _cases(reset: str):
    g = torch.Generator().manual_seed(0)
    v0s = [None, 0.3, torch.rand(6, generator=g)] if reset == "subtract" else [None]
    for theta in (torch.tensor(0.5), torch.rand(6, generator=g) + 0.1):
        for v0 in v0s:
            for shape in ((6, 5, 5), (6,)):
                yield IFNeuron(theta, T=7, reset=reset, v_init=v0), _inputs(g, 7, shape)


def _by_the_step(m: IFNeuron, seq: torch.Tensor) -> torch.Tensor:
    """:func:`if_sequence` as the module docstring states it: in units of theta from ``v_init``
    (subtractive reset), in input units from 0 (hard reset)."""
    if m.reset == "zero":
        return if_sequence(seq, torch.zeros(()), channel_view(m.theta, seq.dim() - 1), reset="zero")
    u = seq / channel_view(m.theta, seq.dim(), channel_dim=2)
    return if_sequence(u, channel_view(m.v_init, u.dim() - 1), 1.0)


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_every_module_path_gives_the_spikes_of_the_step(reset):
    """Without autograd, the in-place kernels; with it, spikingjelly's HalfThresholdIFNode
    (subtract) or the step with the ATan surrogate (zero): the step's spikes, bit for bit."""
    for m, seq in _cases(reset):
        want = _by_the_step(m, seq)
        x = seq.reshape(-1, *seq.shape[2:])
        with torch.no_grad():
            fast = m(x)
        with torch.enable_grad():
            trained = m(x.clone().requires_grad_(True))
        assert want.sum() > 0
        assert torch.equal(fast.reshape(want.shape), want), (m, seq.shape)
        assert torch.equal(trained.detach().reshape(want.shape), want), (m, seq.shape)


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_in_place_kernels_give_the_spikes_of_the_step(reset):
    """fire_subtractive_ and fire_zero directly (the subtractive one also returns the membrane
    the step leaves), and calibration's kernels: fire without a shift, and spike_counts, whose
    running counts are the step's spikes summed."""
    for m, seq in _cases(reset):
        want = _by_the_step(m, seq)
        dims = [d for d in range(seq.dim() - 1) if d != 1]
        counts = spike_counts(m, seq, (3, 7))
        for t in (3, 7):
            assert torch.equal(counts[t], want[:t].sum(0).double().sum(dim=dims))
        if reset == "zero":
            assert torch.equal(fire_zero(seq, channel_view(m.theta, seq.dim() - 1)), want)
            continue
        u = seq / channel_view(m.theta, seq.dim(), channel_dim=2)
        v0 = channel_view(m.v_init, u.dim() - 1)
        v = v0
        for ut in u:
            _, v = if_step(v, ut, 1.0)
        spikes = u.clone()
        assert torch.equal(fire_subtractive_(spikes, v0), v)
        assert torch.equal(spikes, want)
        assert torch.equal(fire(m, u.clone()), want)
