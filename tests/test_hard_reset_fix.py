"""Conversion-side fixes for hard reset: only thresholds and biases change, the neuron stays IF."""

from __future__ import annotations

import copy

import nir
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import snnconv
from snnconv.errors import DataError, StageOrderError
from snnconv.hard_reset import DEFAULT_FACTORS, SHIFT_GRID, calibrate_thresholds, shift_bias
from snnconv.metrics import evaluate
from snnconv.qcfs import calibrate_qcfs
from snnconv.spiking import IFNeuron, neurons, to_spiking


@pytest.fixture(scope="module")
def digits_qcfs(_small_digits_ann, digits_data):
    """(QCFS-ANN, train loader, test loader) of the width-8 digits SmallCNN, L=8."""
    from snnconv.fold import fold_graph
    from snnconv.graph import prepare

    train_set, test_set = digits_data
    train = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    gm = prepare(copy.deepcopy(_small_digits_ann))
    fold_graph(gm, (next(iter(train))[0],))
    return calibrate_qcfs(gm, train, L=8, progress=False), train, DataLoader(test_set, batch_size=256)


def _params(snn):
    return {k: v.clone() for k, v in snn.net.state_dict().items()}


def test_threshold_calibration_changes_only_thresholds_by_grid_factors(digits_qcfs):
    qgm, train, _ = digits_qcfs
    snn = to_spiking(qgm, T=8, reset="zero")
    fixed = calibrate_thresholds(snn, qgm, train, T=8, num_batches=2)
    before, after = _params(snn), _params(fixed)
    assert before.keys() == after.keys()
    for key in before:
        if key.endswith(".theta"):
            assert after[key].shape == before[key].shape == ()  # per layer stays per layer
            ratio = float(after[key] / before[key])
            assert min(abs(ratio - k) for k in DEFAULT_FACTORS) < 1e-6
        else:
            assert torch.equal(before[key], after[key]), key  # weights and biases untouched
    assert {m.reset for m in neurons(fixed.net).values()} == {"zero"}
    assert fixed.T == snn.T
    for key, value in _params(snn).items():  # the input network is not changed
        assert torch.equal(value, before[key])
    layers = fixed.meta["threshold_calibration"]["layers"]
    assert set(layers) == set(neurons(fixed.net))
    # 1.0 is in the grid, so the fitted error is never worse than the unchanged neuron's
    assert all(r["mse"] <= r["mse_before"] for r in layers.values())
    assert any(r["factor"] != 1.0 for r in layers.values())


def test_joint_shift_goes_into_the_feeding_bias_exactly(digits_qcfs):
    qgm, train, _ = digits_qcfs
    T = 4
    snn = to_spiking(qgm, T=T, reset="zero")
    fixed = calibrate_thresholds(snn, qgm, train, T=T, num_batches=1, shifts=SHIFT_GRID,
                                 factors=(0.5, 0.7, 1.0))
    layers = fixed.meta["threshold_calibration"]["layers"]
    assert any(r["shift"] != 0 for r in layers.values())
    # each neuron's input moved by exactly shift * theta' / T per step, through its layer's bias
    names = {"if_relu": "conv1", "if_relu_1": "conv2", "if_relu_2": "conv3", "if_relu_3": "fc1"}
    old, new = snn.net.state_dict(), fixed.net.state_dict()
    for neuron_name, layer in names.items():
        r = layers[neuron_name]
        expect = new[f"{neuron_name}.theta"] * (r["shift"] / T)
        torch.testing.assert_close(new[f"{layer}.bias"] - old[f"{layer}.bias"],
                                   expect.expand_as(old[f"{layer}.bias"]), rtol=0, atol=1e-6)


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


def _spikingjelly_run(path, x, T, layers):
    from spikingjelly.activation_based.nir_exchange import import_from_nir

    net = import_from_nir(str(path), dt=1.0)
    spikes = {n: [] for n in layers}
    for n in layers:
        getattr(net, n).register_forward_hook(lambda mod, i, o, n=n: spikes[n].append(o[0].detach()))
    outs, state = [], None
    with torch.no_grad():
        for _ in range(T):
            out, state = net(x, state)
            outs.append(out)
    return torch.stack(outs), {n: torch.cat(s) for n, s in spikes.items()}


def test_converted_hard_reset_network_is_still_plain_if(digits_qcfs, small_digits_ann, digits_data, tmp_path):
    """convert(reset='zero') calibrates thresholds by default; the file is plain NIR IF and
    spikingjelly's importer gives the same spikes in every layer."""
    _, train, _ = digits_qcfs
    T = 8
    snn, meta = snnconv.convert(small_digits_ann, train, T=T, L=8, reset="zero", progress=False)
    assert meta.settings["threshold_calibration"] is True
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
    spikes = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: spikes.__setitem__(n, o.detach().clone()))
             for n, m in neurons(snn.net).items()]
    with torch.no_grad():
        ours = snn.run(x, T)
    for h in hooks:
        h.remove()
    theirs, their_spikes = _spikingjelly_run(path, x, T, list(spikes))
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
        calibrate_thresholds(snn, qgm, train, factors=(0.5, -1.0))
    with pytest.raises(ValueError, match="1.0"):
        calibrate_thresholds(snn, qgm, train, factors=(0.5, 0.8))
    with pytest.raises(DataError, match="empty"):
        calibrate_thresholds(snn, qgm, [])
    with pytest.raises(StageOrderError, match="to_spiking"):
        calibrate_thresholds(qgm, qgm, train)
    with pytest.raises(StageOrderError, match="to_spiking"):
        shift_bias(IFNeuron(1.0))
