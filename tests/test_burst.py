"""Burst neurons (up to B spikes in one step): one step definition that every path gives bit for
bit, the QCFS limit at L = T * B, files, refusals; the NIR form (B Thresholds and their sum)."""

from __future__ import annotations

import nir
import pytest
import torch

import snnconv
from snnconv.errors import ConfigError, NIRError
from snnconv.snn.neuron import IFNeuron, emit, fire_subtractive_, if_sequence, if_step
from snnconv.snn.nir_io import from_nir, load_nir, save_nir


@pytest.mark.parametrize("burst", [1, 2, 3, 8])
def test_emit_is_the_step(burst):
    """emit(h) is the sum over k of h >= k (units of theta), capped at B; B = 1 is h >= 1."""
    h = torch.linspace(-2, burst + 3, 997)
    expected = sum((h >= k).float() for k in range(1, burst + 1))
    assert torch.equal(emit(h, burst), expected)
    s, v = if_step(torch.zeros_like(h), h, 1.0, burst=burst)
    assert torch.equal(s, expected) and torch.equal(v, h - expected)


@pytest.mark.parametrize("burst", [2, 5])
def test_kernels_and_gradient_path_give_the_same_spikes(burst):
    """The in-place kernel (inference), the step sequence and the autograd path (fine-tuning)
    of IFNeuron agree bit for bit; a golden trajectory checks the step itself."""
    torch.manual_seed(0)
    T, theta = 6, torch.tensor([0.5, 1.0, 2.0])
    x = torch.randn(T * 4, 3, 5) * 3
    mod = IFNeuron(theta, T, burst=burst)
    with torch.no_grad():
        fast = mod(x)
    slow = mod(x.clone().requires_grad_(True)).detach()
    seq = x.reshape(T, 4, 3, 5) / theta.reshape(1, 3, 1)
    ref = if_sequence(seq, torch.full_like(seq[0], 0.5), 1.0, burst=burst).reshape(x.shape)
    assert torch.equal(fast, ref) and torch.equal(slow, ref)
    assert float(fast.max()) <= burst and bool((fast == fast.round()).all())
    # golden: theta 1, v0 1/2, input 2.6 every step, B = 2: h = 3.1 -> 2 spikes, v = 1.1;
    # h = 3.7 -> 2, v = 1.7; h = 4.3 -> 2, v = 2.3 (the charge beyond B waits)
    u = torch.full((3, 1), 2.6)
    spikes = u.clone()
    fire_subtractive_(spikes, torch.tensor(0.5), burst=2)
    assert spikes.flatten().tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("burst", [2, 4])
def test_a_burst_neuron_on_a_constant_input_is_qcfs_at_T_times_B_levels(burst):
    """T steps of a burst neuron with threshold lambda / B on a constant input give QCFS at
    L = T * B levels on [0, lambda]: the rate limit the network's rate() uses."""
    from snnconv.activation import QCFS

    T, lam = 4, 1.5
    z = torch.linspace(-0.5, 2.0, 1001).reshape(-1, 1)
    mod = IFNeuron(lam / burst, T, burst=burst)
    with torch.no_grad():
        rate = mod(z.repeat(T, 1)).reshape(T, -1, 1).mean(0) * (lam / burst)
        mod.rate_levels = T
        limit = mod(z) * (lam / burst)
    qcfs = QCFS(L=T * burst, lam=lam)(z)
    assert torch.allclose(rate, qcfs, atol=1e-6)
    assert torch.allclose(limit, qcfs, atol=1e-6)


def test_convert_with_bursts_saves_loads_and_exports_to_nir(small_digits_ann, digits_loaders, tmp_path):
    train, test = digits_loaders
    snn, meta = snnconv.convert(small_digits_ann, train, T=2, burst=4, finetune_epochs=0, progress=False)
    assert meta.settings["burst"] == 4 and meta.settings["L"] == 8
    units = list(snnconv.snn.neuron.neurons(snn.net).values())
    assert units and all(m.burst == 4 for m in units)
    x = next(iter(test))[0][:32]
    path = tmp_path / "snn.pt"
    snn.save(path)
    again = snnconv.SpikingNetwork.load(path)
    assert torch.equal(snn(x), again(x))
    graph = snnconv.export_nir(snn)
    integrators = [n for n in graph.nodes.values() if type(n).__name__ == "I"]
    assert integrators and all(n.metadata["burst"] == 4 for n in integrators)
    assert sum(type(n).__name__ == "Threshold" for n in graph.nodes.values()) == 4 * len(integrators)
    save_nir(graph, tmp_path / "snn.nir")
    back = from_nir(load_nir(tmp_path / "snn.nir"))
    assert torch.equal(snn(x), back(x))
    assert all(m.burst == 4 for m in snnconv.snn.neuron.neurons(back.net).values())


def test_a_burst_pattern_that_does_not_add_up_is_refused(small_digits_ann, digits_loaders):
    train, _ = digits_loaders
    snn, _ = snnconv.convert(small_digits_ann, train, T=2, burst=2, finetune_epochs=0, progress=False)
    graph = snnconv.export_nir(snn)
    fire2 = next(n for n in graph.nodes if n.endswith("_fire2"))
    graph.nodes[fire2] = nir.Threshold(graph.nodes[fire2].threshold * 1.5)  # not theta * (2 - v_init)
    with pytest.raises(NIRError, match="2 - v_init"):
        from_nir(graph)
    graph = snnconv.export_nir(snn)
    integrator = next(n for n in graph.nodes.values() if type(n).__name__ == "I")
    integrator.metadata["burst"] = 3  # metadata says 3, the graph has 2 Thresholds
    with pytest.raises(NIRError, match="exactly 3 Thresholds"):
        from_nir(graph)


def test_burst_needs_subtractive_reset():
    with pytest.raises(ConfigError, match="resets by subtraction"):
        snnconv.ConvertConfig(burst=2, reset="zero")
    with pytest.raises(ConfigError, match="burst"):
        IFNeuron(1.0, 4, burst=0)
    with pytest.raises(ConfigError, match="resets by subtraction"):
        IFNeuron(1.0, 4, burst=2, reset="zero")
