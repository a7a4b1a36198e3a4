"""Conversion-side fixes for hard reset: only thresholds and biases change, the neuron stays IF."""

from __future__ import annotations

import copy

import nir
import pytest
import torch
import torch.nn as nn
from _probes import run_with_spikes, spikingjelly_run
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.metrics import evaluate
from snnconv.calibration import calibrate_thresholds, shift_bias
from snnconv.errors import DataError, StageOrderError
from snnconv.snn.neuron import IFNeuron, neurons
from snnconv.stages.qcfs import calibrate_qcfs
from snnconv.stages.spiking import to_spiking


@pytest.fixture(scope="module")
def digits_qcfs(_small_digits_ann, digits_data):
    """(QCFS-ANN, train loader, test loader) of the width-8 digits SmallCNN, L=8."""
    from snnconv.graph import prepare
    from snnconv.stages.fold import fold_graph

    train_set, test_set = digits_data
    train = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    gm = prepare(copy.deepcopy(_small_digits_ann))
    fold_graph(gm, (next(iter(train))[0],))
    return calibrate_qcfs(gm, train, L=8, progress=False), train, DataLoader(test_set, batch_size=256)


@pytest.mark.parametrize("per_channel", [False, True])
def test_factors_are_the_thresholds_they_claim(digits_qcfs, digits_data, per_channel):
    """Without rescaling, the calibrated network fires like the original one with each
    threshold multiplied by its recorded factor(s), while its own thresholds stay per layer
    (the factor is written as a scaling of the neuron's input layer)."""
    qgm, train, _ = digits_qcfs
    T = 8
    snn = to_spiking(qgm, T=T, reset="zero")
    fixed = calibrate_thresholds(snn, qgm, train, T=T, num_batches=2, rescale=False,
                                 per_channel=per_channel)
    layers = fixed.meta["threshold_calibration"]["layers"]
    assert set(layers) == set(neurons(fixed.net)) and all(r["input_scaled"] for r in layers.values())
    assert any(torch.as_tensor(r["factor"]).ne(1.0).any() for r in layers.values())
    # 1.0 is in the grid, so the fitted error is never worse than the unchanged neuron's
    assert all(r["mse"] <= r["mse_before"] + 1e-12 for r in layers.values())
    expect = copy.deepcopy(snn)
    for name, m in neurons(expect.net).items():
        m.theta.data = m.theta.data * torch.as_tensor(layers[name]["factor"], dtype=torch.float32)
        assert neurons(fixed.net)[name].theta.shape == ()  # per layer stays per layer
        assert torch.equal(neurons(fixed.net)[name].theta, neurons(snn.net)[name].theta)
    assert {m.reset for m in neurons(fixed.net).values()} == {"zero"}
    x = torch.stack([digits_data[1][i][0] for i in range(64)])
    out_a, spk_a = run_with_spikes(fixed, x, T)
    out_b, spk_b = run_with_spikes(expect, x, T)
    assert sum(float(s.sum()) for s in spk_a.values()) > 0
    for name in spk_a:  # the same spikes up to float rounding at exact ties
        assert (spk_a[name] != spk_b[name]).float().mean() < 1e-3, name
    torch.testing.assert_close(out_a, out_b, rtol=1e-3, atol=1e-3)


def test_residual_network_scales_both_branches_of_the_add():
    """In a ResNet the neurons after an add get their factor through both summed branches
    (the conv and the shortcut conv or identity Scale): the same spikes as threshold k*theta."""
    from snnconv.models import CifarResNet

    torch.manual_seed(0)
    from snnconv.graph import prepare
    from snnconv.stages.fold import fold_graph

    model = prepare(CifarResNet([1, 1], [4, 8], num_classes=3, in_channels=1).eval())
    x = torch.rand(32, 1, 8, 8)
    fold_graph(model, (x,))
    q = calibrate_qcfs(model, [(x, torch.zeros(32, dtype=torch.long))], L=4, progress=False)
    T = 8
    snn = to_spiking(q, T=T, reset="zero")
    fixed = calibrate_thresholds(snn, q, [x], T=T, rescale=False)
    layers = fixed.meta["threshold_calibration"]["layers"]
    assert len(layers) == 5 and all(r["input_scaled"] for r in layers.values())
    expect = copy.deepcopy(snn)
    for name, m in neurons(expect.net).items():
        m.theta.data = m.theta.data * layers[name]["factor"]
    out_a, spk_a = run_with_spikes(fixed, x, T)
    out_b, spk_b = run_with_spikes(expect, x, T)
    assert sum(float(s.sum()) for s in spk_a.values()) > 0
    for name in spk_a:
        assert (spk_a[name] != spk_b[name]).float().mean() < 1e-3, name
    torch.testing.assert_close(out_a, out_b, rtol=1e-3, atol=1e-3)


def test_rescaled_calibration_keeps_threshold_equal_to_output_scale(digits_qcfs):
    """With the fitted output scale c, a neuron's threshold becomes c * theta and its
    consumers' weights are multiplied by c: spikes still carry their threshold."""
    qgm, train, _ = digits_qcfs
    snn = to_spiking(qgm, T=8, reset="zero")
    fixed = calibrate_thresholds(snn, qgm, train, T=8, num_batches=2)
    layers = fixed.meta["threshold_calibration"]["layers"]
    old, new = snn.net.state_dict(), fixed.net.state_dict()
    for name, r in layers.items():
        torch.testing.assert_close(new[f"{name}.theta"], old[f"{name}.theta"] * r["output_scale"])
    # fc2 (the readout) reads only if_relu_3: its weights carry exactly that output scale
    torch.testing.assert_close(new["fc2.weight"], old["fc2.weight"] * layers["if_relu_3"]["output_scale"])
    torch.testing.assert_close(new["fc2.bias"], old["fc2.bias"])
    assert all(r["mse"] <= r["mse_before"] + 1e-12 for r in layers.values())
    assert fixed.T == snn.T


def test_shift_bias_adds_theta_over_2T_to_every_neuron_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.rand(16, 5)
    q = calibrate_qcfs(model, [(x, torch.zeros(16, dtype=torch.long))], L=4, progress=False)
    T = 8
    snn = to_spiking(q, T=T, reset="zero")
    shifted = shift_bias(snn)

    def inputs(net):
        seen = {}
        hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, a[0].clone()))
                 for n, m in neurons(net.net).items()]
        with torch.no_grad():
            net(x)
        for h in hooks:
            h.remove()
        return seen

    a, b = inputs(snn), inputs(shifted)
    assert len(a) == 2
    # the first neuron sees the same static input plus exactly theta / (2T) at every step
    first, m = next(iter(neurons(snn.net).items()))
    torch.testing.assert_close(b[first] - a[first], (m.theta / (2 * T)).expand_as(a[first]),
                               rtol=0, atol=1e-6)
    # and every neuron's feeding bias moved by exactly its theta / (2T), nothing else
    old, new = snn.net.state_dict(), shifted.net.state_dict()
    rec = shifted.meta["bias_shift"]["layers"]
    for n, m in neurons(snn.net).items():
        layer = rec[n]["layer"]
        torch.testing.assert_close(new[f"{layer}.bias"] - old[f"{layer}.bias"],
                                   (m.theta / (2 * T)).expand_as(old[f"{layer}.bias"]), rtol=0, atol=1e-6)
    assert all(torch.equal(old[k], new[k]) for k in old if not k.endswith(".bias"))
    assert {m.reset for m in neurons(shifted.net).values()} == {"zero"}


def test_converted_hard_reset_network_is_still_plain_if(digits_qcfs, small_digits_ann, digits_data, tmp_path):
    """convert(reset='zero') trains the ANN for the hard-reset rate and tries the threshold fit
    by default; the file is plain NIR IF and spikingjelly's importer gives the same spikes in
    every layer."""
    _, train, _ = digits_qcfs
    T = 8
    snn, meta = snnconv.convert(small_digits_ann, train, T=T, L=8, reset="zero", progress=False)
    assert meta.settings["threshold_calibration"] is True
    assert meta.settings["hard_rate"] is True and meta.settings["qcfs_epochs"] >= 1
    assert "threshold_calibration" in snn.meta and "bias_calibration" in snn.meta
    graph = snnconv.export_nir(snn)
    ifs = [n for n in graph.nodes.values() if isinstance(n, nir.IF)]
    assert len(ifs) == len(neurons(snn.net))
    assert not any(isinstance(n, (nir.I, nir.Threshold, nir.LIF)) for n in graph.nodes.values())
    for node in ifs:
        assert (node.v_reset == 0).all() and len(set(node.v_threshold.reshape(-1).tolist())) == 1
    path = tmp_path / "hard.nir"
    snnconv.save_nir(graph, path)
    x = torch.stack([digits_data[1][i][0] for i in range(6)])
    ours, spikes = run_with_spikes(snn, x, T)
    theirs, their_spikes = spikingjelly_run(path, x, T, list(spikes))
    assert sum(float(s.sum()) for s in spikes.values()) > 0
    for layer, s in spikes.items():
        assert torch.equal(s, their_spikes[layer]), layer
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_default_is_off_for_subtractive_reset_and_can_be_turned_off(small_digits_ann, digits_qcfs):
    _, train, _ = digits_qcfs
    soft, meta = snnconv.convert(copy.deepcopy(small_digits_ann), train, T=4, L=4, progress=False)
    assert meta.settings["threshold_calibration"] is False and "threshold_calibration" not in soft.meta
    hard, meta = snnconv.convert(small_digits_ann, train, T=4, L=4, reset="zero",
                                 threshold_calibration=False, on_collapse="warn", progress=False)
    assert "threshold_calibration" not in hard.meta


def test_threshold_calibration_rescues_hard_reset_accuracy(digits_qcfs):
    """On digits at T=16 the calibrated hard-reset network is far more accurate than the plain one."""
    qgm, train, test = digits_qcfs
    plain = to_spiking(qgm, T=16, reset="zero")
    fixed = calibrate_thresholds(plain, qgm, train, T=16)
    a, b = evaluate(plain, test), evaluate(fixed, test)
    assert b > a + 20


def test_bad_input_is_refused(digits_qcfs):
    qgm, train, _ = digits_qcfs
    snn = to_spiking(qgm, T=4, reset="zero")
    with pytest.raises(ValueError, match="factors"):
        calibrate_thresholds(snn, qgm, train, factors=(0.5, -1.0, 1.0))
    with pytest.raises(ValueError, match="1.0"):
        calibrate_thresholds(snn, qgm, train, factors=(0.5, 0.8))
    with pytest.raises(ValueError, match="per_channel"):
        calibrate_thresholds(snn, qgm, train, per_channel=True)
    with pytest.raises(DataError, match="empty"):
        calibrate_thresholds(snn, qgm, [])
    with pytest.raises(StageOrderError, match="to_spiking"):
        calibrate_thresholds(qgm, qgm, train)
    with pytest.raises(StageOrderError, match="to_spiking"):
        shift_bias(IFNeuron(1.0))
