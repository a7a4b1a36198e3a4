"""Loihi 2 for the networks users bring: a static input anywhere in the graph, one
threshold per channel where one per population would flush a layer, and a quantisation that
departs from the float network is never silent.

Properties: the analog prefix's output reaching a residual shortcut runs on loihi2-sim and in
Lava with identical spikes; a channel with a floored threshold no longer flushes its layer
(per-channel thresholds), and when per-channel thresholds are turned off the run warns and
``snnconv run --strict`` exits 1; rescaling a neuron's weight row, bias and threshold by a
positive factor changes neither the float spikes nor the integer network.
"""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from _loihi_nets import small_graph
from _loihi_stem import stem_snn

import snnconv
from snnconv.nir.format import fire_threshold, spec_threshold
from snnconv.snn.nir_io import export_nir
from snnconv_backends.lava import LavaBackend
from snnconv_backends.loihi2 import Loihi2SimBackend, QuantisationWarning, quantize

T = 8


def _lava_or_skip():
    ok, reason = LavaBackend().availability()
    if not ok:
        pytest.skip(f"Lava side environment missing: {reason}")


def _dead_channel(reset: str, seed: int = 1):
    """``small_graph`` with channel 0 of ``n2`` at threshold 1e-3 (a channel calibration left
    silent): with one threshold per population its rows set the scale of every channel."""
    g = small_graph(reset, seed=seed)
    if reset == "zero":  # NIR's threshold: one float32 step below theta
        g.nodes["n2"].v_threshold[0] = spec_threshold(1e-3)
    else:  # theta lives in the reset Scale (-theta) and the fire threshold (theta - v0)
        old = float(-g.nodes["n2_reset"].scale[0, 0, 0])
        g.nodes["n2_reset"].scale[0] *= 1e-3 / old
        _rewrite_fire_threshold(g, "n2")
    return g


def _rewrite_fire_threshold(g, name):
    """Set subtractive neuron ``name``'s fire threshold from its reset Scale (``-theta``)."""
    g.nodes[f"{name}_fire"].threshold[...] = spec_threshold(fire_threshold(-g.nodes[f"{name}_reset"].scale, 0.5))


def _prefix_input(snn, x):
    with torch.no_grad():
        return snnconv.constructs.prefix.analog_prefix(snn)(x)


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_a_static_input_beside_spikes_runs_as_a_bias_current(reset):
    """The max-pooled stem feeds the first block's shortcut: that population gets the stem's
    output as a bias current from its own first step, and follows the float network."""
    snn, x = stem_snn(reset)
    graph = export_nir(snn)
    q = quantize(graph)
    late = [p for p in q.populations if p.late_static]
    assert late and all(p.depth > 0 for p in late)
    z = _prefix_input(snn, x[:16])
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantisationWarning)
        sim = Loihi2SimBackend().compile(graph).run(z, T)
    cpu = snnconv.backends.get("cpu").compile(graph).run(z, T)
    for name, c in sim.spikes.items():
        want = float(cpu.spikes[name].sum())
        assert abs(float(c.sum()) - want) <= 0.05 * want + 10, name
    assert sim.extra["fidelity"]["warnings"] == []


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_lava_and_sim_agree_on_the_static_input_bit_for_bit(reset):
    _lava_or_skip()
    snn, x = stem_snn(reset, seed=1)
    graph = export_nir(snn)
    z = _prefix_input(snn, x[:2])
    sim = Loihi2SimBackend().compile(graph, record=True).run(z, T)
    lava = LavaBackend().compile(graph).run(z, T)
    assert lava.extra["lava"]["idle_before_window"]
    for name, v in sim.extra["trace"]["v"].items():
        assert torch.equal(v.reshape(lava.extra["trace"]["v"][name].shape), lava.extra["trace"]["v"][name]), name
    for name, s in sim.extra["trace"]["s"].items():
        assert torch.equal(s.reshape(lava.extra["trace"]["s"][name].shape), lava.extra["trace"]["s"][name]), name
    assert torch.equal(sim.outputs, lava.outputs)


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_lava_and_sim_agree_with_per_channel_thresholds(reset):
    _lava_or_skip()
    g = _dead_channel(reset)
    assert np.ndim(quantize(g).population("n2").vth) == 1
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    sim = Loihi2SimBackend().compile(g, record=True).run(x, 5)
    lava = LavaBackend().compile(g).run(x, 5)
    for name, v in sim.extra["trace"]["v"].items():
        assert torch.equal(v.reshape(lava.extra["trace"]["v"][name].shape), lava.extra["trace"]["v"][name]), name
    assert torch.equal(sim.outputs, lava.outputs)


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_a_dead_channel_flushes_its_layer_only_with_one_threshold(reset):
    """One threshold per population: the floored channel's rows set the scale, the others'
    weights round to zero and the run warns. One per channel: within tolerance, no warning."""
    g = _dead_channel(reset)
    x = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    with pytest.warns(QuantisationWarning, match="n2|n3"):
        bad = Loihi2SimBackend().compile(g, per_neuron_vth=False).run(x, T)
    assert bad.extra["fidelity"]["warnings"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantisationWarning)
        good = Loihi2SimBackend().compile(g).run(x, T)
    fid = good.extra["fidelity"]
    assert fid["warnings"] == [] and fid["lowest_rate_ratio"] > 0.8
    assert max(c["fraction"] for c in fid["connections"].values()) < 0.5
    rep = good.extra["quantisation"]["layers"]["n2"]
    assert rep["vth_per_channel"]["thresholds_raised"] <= 1


def test_rescaling_a_neuron_changes_neither_float_spikes_nor_the_integer_network():
    """Weight row, bias and threshold of one channel times 4 (exact in float): the cpu backend's
    spikes are identical and quantize() builds the same integer weights and thresholds."""
    g = small_graph("zero", seed=5)
    h = copy.deepcopy(g)
    h.nodes["conv2"].weight[1] *= 4
    h.nodes["conv2"].bias[1] *= 4
    h.nodes["n2"].v_threshold[1] *= 4
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(2)) * 2
    cpu = snnconv.backends.get("cpu")
    a, b = cpu.compile(g).run(x, T), cpu.compile(h).run(x, T)
    assert {k: v.tolist() for k, v in a.spikes.items()} == {k: v.tolist() for k, v in b.spikes.items()}
    qa, qb = quantize(g), quantize(h)
    for pa, pb in zip(qa.populations, qb.populations):
        assert np.array_equal(np.asarray(pa.vth), np.asarray(pb.vth))
        for ca, cb in zip(pa.conns, pb.conns):
            assert ca.exp == cb.exp and np.array_equal(ca.mant, cb.mant), ca.name


def test_run_warns_and_strict_exits_1(tmp_path, capsys):
    from snnconv.cli import main
    from snnconv.nir.file import save_nir

    path = tmp_path / "dead.nir"
    save_nir(_dead_channel("zero"), path)
    args = ["run", str(path), "--backend", "loihi2-sim", "--data", "digits", "--limit", "64",
            "--T", "6", "--quiet", "--out", str(tmp_path)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, as one printed line: not a Python warning too
        assert main(args + ["--option", "per_neuron_vth=false"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("quantisation departs") == 1 and "quantisation departs" not in captured.err
    assert "WARNING: loihi2-sim: quantisation departs" in captured.out and "benchmarks" not in captured.out
    # one record per setting: the option's run is kept beside the default's
    rec = json.loads(next((tmp_path / "backends").glob("loihi2-sim_T6_digits_64img_*.json")).read_text())
    assert rec["quantisation_check"]["warnings"]
    assert main(args + ["--option", "per_neuron_vth=false", "--strict"]) == 1
    assert main(args + ["--strict"]) == 0
    rec = json.loads((tmp_path / "backends" / "loihi2-sim_T6_digits_64img.json").read_text())
    assert rec["quantisation_check"]["warnings"] == []


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_a_trained_network_with_a_max_pooling_stem_agrees_with_cpu(reset):
    """StemNet trained on digits (12x12, three channels, 15 epochs: ANN 97-98%), converted
    training-free at T=8: loihi2-sim takes the cpu backend's decision on at least 95% of the 449
    test images (measured 99.1-99.8% over two seeds and both resets; the float network's own
    decisions under a 1e-4 relative input perturbation: 99.8-100%), without a warning."""
    import torch.nn.functional as F
    from _loihi_stem import StemNet
    from torch.utils.data import DataLoader, TensorDataset

    from snnconv.data import digits
    from snnconv.demo import train_ann

    def rgb12(d):
        x = F.interpolate(d.tensors[0], size=(12, 12), mode="bilinear", align_corners=False)
        return TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), d.tensors[1])

    tr, te = (rgb12(d) for d in digits(seed=0))
    torch.manual_seed(0)
    ann = train_ann(StemNet(c=8, classes=10), DataLoader(tr, batch_size=64, shuffle=True,
                                                         generator=torch.Generator().manual_seed(0)),
                    epochs=15, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snn, _ = snnconv.convert(ann, DataLoader(tr, batch_size=128), T=T, finetune_epochs=0,
                                 reconstruction_steps=0, reset=reset, progress=False)
    graph = export_nir(snn)
    q = quantize(graph)
    assert any(p.late_static for p in q.populations)  # the stem's output reaches a shortcut
    assert all(c.kind != "bias" for p in q.populations for c in p.conns)  # biases: bias currents
    z = _prefix_input(snn, te.tensors[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantisationWarning)
        chip = Loihi2SimBackend().compile(graph).run(z, T)
    cpu = snnconv.backends.get("cpu").compile(graph).run(z, T)
    agree = (chip.outputs.mean(0).argmax(1) == cpu.outputs.mean(0).argmax(1)).float().mean()
    assert float(agree) >= 0.95


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_decisions_that_depart_from_the_float_network_warn_over_enough_images(reset):
    """Rates within tolerance are not enough: a chip whose decisions are the float network's on
    fewer than DECISION_TOLERANCE of at least MIN_IMAGES images warns; too few images are no
    evidence either way; the run records the agreement it measured."""
    from snnconv_backends.loihi2.fidelity import DECISION_TOLERANCE, MIN_IMAGES, check

    g = small_graph(reset, seed=1)
    x = torch.rand(MIN_IMAGES, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantisationWarning)
        res = Loihi2SimBackend().compile(g).run(x, T)
    fid = res.extra["fidelity"]
    assert fid["decisions"][1] == MIN_IMAGES and fid["decision_agreement"] >= DECISION_TOLERANCE
    q = Loihi2SimBackend().compile(g).q
    chip = {k: v for k, v in res.spikes.items()}
    low = int(MIN_IMAGES * DECISION_TOLERANCE) - 1
    assert any("decisions" in w for w in check(q, chip, chip, MIN_IMAGES, T, (low, MIN_IMAGES))["warnings"])
    assert check(q, chip, chip, MIN_IMAGES - 1, T, (0, MIN_IMAGES - 1))["warnings"] == []
    assert check(q, chip, chip, MIN_IMAGES, T, (MIN_IMAGES, MIN_IMAGES))["warnings"] == []


def test_a_layer_whose_every_channel_exceeds_the_input_budget_runs_and_is_judged():
    """Every channel of n2 at a threshold 1e-7 (its worst-case input is more than 32767 times
    it even at vth = 1): each channel's threshold is raised until it fits and the fidelity check
    judges the result, instead of the graph being refused (a channel that fires at every step in
    the float network still does)."""
    g = small_graph("zero", seed=1)
    g.nodes["n2"].v_threshold[:] = spec_threshold(1e-7)
    x = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    res = Loihi2SimBackend().compile(g).run(x, T)
    assert res.extra["quantisation"]["layers"]["n2"]["vth_per_channel"]["thresholds_raised"] >= 1
    fid = res.extra["fidelity"]
    assert fid["layers"]["n2"]["ratio"] == pytest.approx(1.0, abs=0.2) or fid["warnings"]


def test_a_linear_bottleneck_runs_as_one_convolution():
    """A 1x1 convolution without an activation, then a convolution (MobileNetV2 between blocks):
    one integer convolution on the chip (not a dense matrix, which at 32 px was too large to
    build), following the float network."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Bottleneck(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.project = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
            self.expand, self.fc = nn.Conv2d(4, 8, 3, padding=1), nn.Linear(8, 3)

        def forward(self, x):
            x = self.project(F.relu(self.a(x)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.expand(x)), 1), 1))

    torch.manual_seed(0)
    x = torch.rand(64, 1, 8, 8)
    snn, _ = snnconv.convert(Bottleneck().eval(), [(x, torch.zeros(64, dtype=torch.long))], T=T,
                             finetune_epochs=0, reconstruction_steps=0, progress=False, on_collapse="warn")
    graph = snnconv.export_nir(snn)
    program = Loihi2SimBackend().compile(graph)
    kinds = {c.name: c.kind for p in program.q.populations for c in p.conns}
    assert kinds.get("expand") == "conv", kinds
    res = program.run(x, T)
    fid = res.extra["fidelity"]
    assert fid["decision_agreement"] >= 0.9 and fid["lowest_rate_ratio"] > 0.8


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_saturating_biases_are_clipped_without_changing_a_spike(reset):
    """A bias beyond threshold + |most negative input| (fires at every step) or below -(largest
    input) (never fires) is clipped to that bound: the IF neuron's spikes (snnconv.snn.neuron.if_step)
    are the same for any input within the bounds, any initial membrane in [0, theta]."""
    from snnconv.snn.neuron import if_step
    from snnconv_backends.loihi2.quantisation import _saturating_bias

    rng = np.random.default_rng(0)
    n, T = 4000, 24
    theta = rng.uniform(0.1, 3.0, n)
    pos, neg = rng.uniform(0, 5, n), -rng.uniform(0, 5, n)
    bias = rng.normal(0, 1, n) * 10.0 ** rng.integers(-1, 4, n)  # up to thousands of thresholds
    clipped = _saturating_bias(bias, pos, neg, theta)
    assert (clipped != bias).mean() > 0.3 and np.abs(clipped).max() <= (5 + 3.0) * 1.01
    for v0 in (0.0, 0.5, 1.0):
        va = vb = torch.as_tensor(v0 * theta)
        for t in range(T):
            u = rng.uniform(0, 1, n)
            u = np.where(u < 0.1, 0.0, np.where(u > 0.9, 1.0, u))  # the extremes included
            x = torch.as_tensor(neg + (pos - neg) * u)
            sa, va = if_step(va, x + torch.as_tensor(bias), torch.as_tensor(theta), reset=reset)
            sb, vb = if_step(vb, x + torch.as_tensor(clipped), torch.as_tensor(theta), reset=reset)
            assert torch.equal(sa, sb), (v0, t)


def test_saturating_biases_leave_the_layer_its_threshold_bits():
    """Two channels whose biases calibration pushed to +-1000 thresholds (one always firing, one
    silent) no longer set the layer's integer scale: the layer keeps a threshold of many bits,
    and the chip's spikes of those channels are the float network's (all, none)."""
    g = small_graph("subtract", seed=2)
    b = np.asarray(g.nodes["conv2"].bias, np.float32).copy()
    b[0], b[1] = 1000.0, -1000.0
    g.nodes["conv2"].bias = b
    q = quantize(g)
    assert int(np.min(q.population("n2").vth)) >= 64
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = Loihi2SimBackend().compile(g, record=True).run(x, 6).extra["trace"]["s"]["n2"]
    s = s.reshape(6, 4, 4, 8, 8)
    assert bool(s[:, :, 0].all()) and not bool(s[:, :, 1].any())


def test_auto_weight_groups_refine_only_the_connections_that_need_it():
    """weight_groups="auto" (the default): a connection whose 8-bit weights' relative rounding
    error exceeds SECOND_GROUP_ERROR (a few large outliers) gains a residual group; the others
    keep one."""
    from snnconv_backends.loihi2.quantisation import SECOND_GROUP_ERROR

    g = small_graph("zero", seed=5, channels=32)
    w = np.asarray(g.nodes["conv3"].weight, np.float32).copy()
    w[0, 0, 1, 1] = 60 * float(np.sqrt((w**2).mean()))  # one outlier sets the shared exponent
    g.nodes["conv3"].weight = w
    one = {c.name: c for p in quantize(g, weight_groups=1).populations for c in p.conns}
    auto = {c.name for p in quantize(g).populations for c in p.conns}
    needs = {n for n, c in one.items() if c.report["rel_error"] > SECOND_GROUP_ERROR}
    assert "conv3" in needs and needs != set(one)
    assert {n[:-3] for n in auto if n.endswith(".lo")} == needs


@pytest.mark.parametrize("split", [False, True])
def test_weights_below_the_finest_step_round_to_zero_there(split):
    """A connection (or the rounding residual that a second synapse group would carry) whose
    weights all lie below the finest step of the exponent range quantises at that step: its
    weights flushed and counted, not a failure (torchvision's squeezenet1_0 at 35 px had such
    a residual under ``weight_groups="auto"``)."""
    from snnconv_backends.loihi2.chip import LOIHI
    from snnconv_backends.loihi2.quantisation import _quantize_weights

    for w in (np.full((3, 4), 1e-6), np.array([[1e-6, -3e-6, 0.0]])):
        m, e, rep = _quantize_weights(w, bias=False, split=split)
        assert e == LOIHI["weight_exp_min"] and not m.any()
        assert rep["zero_rounded"] == np.count_nonzero(w) and rep["rel_error"] == 1.0


@pytest.mark.parametrize("factor", [1e-2, 5e-2])
def test_a_threshold_below_the_per_channel_bound_gets_one_per_channel(factor):
    """Whenever a population's one threshold would be below ``_VTH_PER_CHANNEL`` (here set by a
    channel at a fraction of its threshold, its rows scaled up against the others'), it gets one
    threshold per channel, and the other channels' weights keep their bits. Per channel the
    connection flushes what its weights' own spread flushes (2%), against 7-24% with one."""
    from snnconv_backends.loihi2.quantisation import _VTH_PER_CHANNEL

    g = small_graph("subtract", seed=1)
    g.nodes["n2_reset"].scale[0] *= factor
    _rewrite_fire_threshold(g, "n2")
    x = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantisationWarning)
        one = Loihi2SimBackend().compile(g, per_neuron_vth=False).run(x, T)
    per = Loihi2SimBackend().compile(g).run(x, T)
    assert one.extra["quantisation"]["layers"]["n2"]["vth"] < _VTH_PER_CHANNEL
    assert "vth_per_channel" in per.extra["quantisation"]["layers"]["n2"]

    def worst(res):
        return max(c["fraction"] for c in res.extra["fidelity"]["connections"].values())
    assert worst(per) < 0.05 < worst(one)
    assert per.extra["fidelity"]["lowest_rate_ratio"] > 0.98


def _densenet_shaped():
    """DenseNet's pre-activation layers, converted: convolutions concatenated, then a BatchNorm
    (which no convolution before it can absorb) and a ReLU; a transition (1x1 convolution, then
    average pooling, no ReLU) between two such blocks. Returns (snn, x)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.grow = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.norm, self.fc = nn.BatchNorm2d(8), nn.Linear(8, 3)
            self.trans, self.grow2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 4, 3, padding=1)
            self.norm2 = nn.BatchNorm2d(8)

        def forward(self, x):
            a = F.relu(self.stem(x))
            x = F.relu(self.norm(torch.cat([a, F.relu(self.grow(a))], 1)))
            y = F.avg_pool2d(self.trans(x), 2)
            x = F.relu(self.norm2(torch.cat([y, F.relu(self.grow2(F.relu(y)))], 1)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    x = torch.rand(64, 1, 8, 8)
    model = Dense()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
        model.norm2.weight.uniform_(0.5, 2.0)
        model.train()(x)
    snn, _ = snnconv.convert(model.eval(), [(x, torch.zeros(64, dtype=torch.long))], T=T,
                             finetune_epochs=0, reconstruction_steps=0, progress=False, on_collapse="warn")
    return snn, x


def test_a_batchnorm_that_reads_a_concatenation_runs_as_one_convolution():
    """Each branch's convolution, its channel placement and the BatchNorm's per-channel scale
    are one convolution on the chip (a dense matrix of DenseNet-121 at 32 px was 10240 x 8192,
    too large to build), and so is a transition; the chip follows the float network."""
    snn, x = _densenet_shaped()
    program = Loihi2SimBackend().compile(snnconv.export_nir(snn))
    kinds = {c.name: c.kind for p in program.q.populations for c in p.conns if c.kind != "bias"}
    assert kinds and set(kinds.values()) <= {"conv", "matrix"} and "conv" in kinds.values(), kinds
    assert all(k == "conv" for n, k in kinds.items() if n != "fc"), kinds
    assert kinds.get("norm2") == "conv", kinds
    fid = program.run(x, T).extra["fidelity"]
    assert fid["decision_agreement"] >= 0.9 and fid["lowest_rate_ratio"] > 0.9


def test_lava_and_sim_agree_on_the_densenet_shaped_net_bit_for_bit():
    """The composed convolutions (placements, per-channel scales, a transition's pooling) run
    in Lava as in the simulator: every membrane, every spike."""
    _lava_or_skip()
    snn, x = _densenet_shaped()
    graph = snnconv.export_nir(snn)
    sim = Loihi2SimBackend().compile(graph, record=True).run(x[:2], T)
    lava = LavaBackend().compile(graph).run(x[:2], T)
    for name, v in sim.extra["trace"]["v"].items():
        assert torch.equal(v.reshape(lava.extra["trace"]["v"][name].shape), lava.extra["trace"]["v"][name]), name
    assert torch.equal(sim.outputs, lava.outputs)


@pytest.mark.parametrize("k, s, p, K, P", [(2, 2, 0, 3, 1), (3, 2, 0, 1, 0), (3, 2, 1, 3, 0), (3, 1, 1, 1, 0),
                                           (2, 2, 0, 1, 0), (3, 3, 0, 2, 1), (3, 2, 0, 3, 1)])
def test_a_pooling_then_a_convolution_composes_into_one_exact_convolution(k, s, p, K, P):
    """Average pooling (any kernel, stride and counted padding) then a stride-1 convolution is one
    convolution on the pooling's input: the same values as the two ops, in float64."""
    import torch.nn.functional as F

    from snnconv.nir.reader import Op
    from snnconv_backends.loihi2.mapping import pool_then_conv

    g = torch.Generator().manual_seed(k * 100 + s * 10 + p + K)
    x = torch.rand(2, 3, 12, 12, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, K, K, generator=g, dtype=torch.float64)
    pool = Op("pool", "avgpool2d", ("in",), {"kernel_size": (k, k), "stride": (s, s), "padding": (p, p)},
              (3, 12, 12), ())
    conv = Op("conv", "conv2d", ("pool",), {"weight": w.numpy(), "stride": (1, 1), "padding": (P, P),
                                            "dilation": (1, 1), "groups": 1}, (), ())
    composed = pool_then_conv(pool, conv)
    pooled = F.avg_pool2d(x, k, s, p, count_include_pad=True)
    if composed is None:  # a padded convolution after an overlapping or padded pooling: not one conv
        assert P and (s != k or p)
        return
    big, params = composed
    want = F.conv2d(pooled, w, padding=P)
    got = F.conv2d(x, torch.from_numpy(big), stride=params["stride"], padding=params["padding"])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)


def test_an_inception_stem_pooling_then_a_1x1_convolution_runs_as_one_convolution():
    """torchvision Inception v3's stem: max-pooling (3, stride 2; average pooling after conversion)
    then a 1x1 convolution. On the chip one convolution of kernel 3, stride 2 (a dense matrix of
    the pair was too large to build at 75 px), following the float network."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.pool, self.c, self.fc = nn.AvgPool2d(3, stride=2), nn.Conv2d(8, 6, 1), nn.Linear(6, 3)

        def forward(self, x):
            x = self.pool(F.relu(self.b(F.relu(self.a(x)))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.c(x)), 1), 1))

    torch.manual_seed(0)
    x = torch.rand(64, 1, 11, 11)
    snn, _ = snnconv.convert(Stem().eval(), [(x, torch.zeros(64, dtype=torch.long))], T=T,
                             finetune_epochs=0, reconstruction_steps=0, progress=False, on_collapse="warn")
    program = Loihi2SimBackend().compile(snnconv.export_nir(snn))
    kinds = {c.name: c.kind for p in program.q.populations for c in p.conns}
    assert kinds.get("c") == "conv", kinds
    fid = program.run(x, T).extra["fidelity"]
    assert fid["decision_agreement"] >= 0.9 and fid["lowest_rate_ratio"] > 0.8


def test_per_channel_scales_before_a_pooling_then_a_convolution_fold_into_the_one_convolution():
    """A source's per-channel output scale, an average pooling (3, stride 2) and a 1x1 convolution
    (Inception v3's ``maxpool2`` before ``Mixed_5b``): one convolution, equal in float64."""
    import torch.nn.functional as F

    from snnconv.nir.reader import Op
    from snnconv_backends.loihi2.mapping import chain_as_conv

    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 3, 12, 12, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, 1, 1, generator=g, dtype=torch.float64)
    s = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    scale = Op("s", "scale", ("in",), {"scale": s.reshape(3, 1, 1).expand(3, 12, 12).numpy()}, (3, 12, 12), ())
    pool = Op("pool", "avgpool2d", ("s",), {"kernel_size": (3, 3), "stride": (2, 2), "padding": (0, 0)},
              (3, 12, 12), ())
    conv = Op("conv", "conv2d", ("pool",), {"weight": w.numpy(), "stride": (1, 1), "padding": (0, 0),
                                            "dilation": (1, 1), "groups": 1}, (), ())
    big, params = chain_as_conv([scale, pool, conv])
    want = F.conv2d(F.avg_pool2d(x * s.reshape(1, 3, 1, 1), 3, 2), w)
    got = F.conv2d(x, torch.from_numpy(big), stride=params["stride"], padding=params["padding"])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)


def test_the_decision_advice_works_from_an_installed_package():
    """The advice of a decision departure names commands of the installed CLI, not the
    benchmarks of a source checkout."""
    from snnconv_backends.loihi2.fidelity import check

    q = quantize(small_graph("subtract"))
    fid = check(q, {}, None, 100, 4, decisions=(50, 100))
    (line,) = [w for w in fid["warnings"] if "decisions" in w]
    assert "snnconv finetune" in line and "benchmarks" not in line
