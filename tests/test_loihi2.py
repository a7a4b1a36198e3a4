"""loihi2-sim (bit-exact fixed-point Loihi 2 model) and lava (Intel's Lava) backends.

Properties: Lava and loihi2-sim give the same membrane voltages and spikes at every step, bit
for bit (both reset modes; skipped only without the .venv-lava side environment); the
simulator's traces satisfy Lava's fixed-point equations, recomputed independently in numpy
from the integer weight matrices; quantisation stays within the bit budget; the simulator
agrees with the float SNN up to quantisation on a trained digits network.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _loihi_nets import small_graph

import snnconv  # noqa: F401  (imports snnconv_backends in the supported order)
from snnconv.errors import BackendError
from snnconv_backends.lava import LavaBackend
from snnconv_backends.loihi2 import CLOCK, LOIHI, Loihi2SimBackend, format_report, quantize

T = 5


def _sim(graph, x, T=T):
    return Loihi2SimBackend().compile(graph, record=True).run(x, T)


@pytest.mark.parametrize("reset,dense_limit,calibrated,split,groups,burst", [
    ("zero", 2**22, False, True, 1, 1), ("subtract", 0, False, True, 1, 1), ("subtract", 2**22, True, True, 1, 1),
    ("zero", 0, False, False, 1, 1), ("zero", 2**22, False, True, 2, 1), ("subtract", 2**22, True, True, 1, 3),
    ("subtract", 0, False, True, 2, 3)])
def test_lava_and_sim_agree_bit_for_bit(reset, dense_limit, calibrated, split, groups, burst):
    """Every population's v and spikes at every step, and the readout, are identical.

    The hard-reset net runs Lava's Dense/DelayDense + LIF; the subtractive one Sparse/
    DelaySparse + the custom SubtractiveIF process (dense_limit=0); the calibrated one has a
    per-channel initial membrane (one integer per neuron). ``split``: mixed-sign connections
    as two single-sign synapse groups (the default), else Lava's mixed sign mode. ``groups=2``:
    every connection's rounding residual as a second connection with a negative exponent.
    ``burst``: neurons that emit up to 3 spikes a step as one graded spike.
    """
    ok, reason = LavaBackend().availability()
    if not ok:
        pytest.skip(f"Lava side environment missing: {reason}")
    g = small_graph(reset, seed=1, calibrated=calibrated, burst=burst)
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    opts = {"split_signs": split, "weight_groups": groups}
    sim = Loihi2SimBackend().compile(g, record=True, **opts).run(x, T)
    lava = LavaBackend().compile(g, dense_limit=dense_limit, **opts).run(x, T)
    if groups == 2:
        lo = [c for p in quantize(g, weight_groups=2).populations for c in p.conns if c.name.endswith(".lo")]
        assert lo and min(c.exp for c in lo) < 0
    assert lava.extra["lava"]["idle_before_window"]
    vs, vl = sim.extra["trace"]["v"], lava.extra["trace"]["v"]
    assert set(vs) == set(vl) == {"n1", "n2", "n3", "n4", "output"}
    for name in vs:
        assert torch.equal(vs[name].reshape(vl[name].shape), vl[name]), name
    for name, s in sim.extra["trace"]["s"].items():
        assert torch.equal(s.reshape(lava.extra["trace"]["s"][name].shape), lava.extra["trace"]["s"][name])
        assert s.any(), f"{name} never spiked: the check would be vacuous"
    assert burst == 1 or max(int(s.max()) for s in sim.extra["trace"]["s"].values()) > 1  # graded spikes
    assert torch.equal(sim.outputs, lava.outputs)
    assert {k: v.tolist() for k, v in sim.spikes.items()} == {k: v.tolist() for k, v in lava.spikes.items()}
    assert sim.synops == pytest.approx(lava.synops)


def _dense(c, shapes):
    rows, cols, vals = c.coo(shapes[c.source], shapes[c.target])
    m = np.zeros((int(np.prod(shapes[c.target])), int(np.prod(shapes[c.source]))), np.int64)
    np.add.at(m, (rows, cols), vals.astype(np.int64))
    return m


@pytest.mark.portable
@pytest.mark.parametrize("reset,burst", [("zero", 1), ("subtract", 1), ("subtract", 3)])
def test_sim_follows_the_fixed_point_equations(reset, burst):
    """Recompute each population step by step with numpy int64 from the integer matrices:
    a = sum_k shift(W_k @ s_k, e_k); u = a << 6; v = clip24(v + u + bias); s = v > vth << 6
    (a burst of up to B: s = clip((v - 1) // (vth << 6), 0, B), a graded spike)."""
    g = small_graph(reset, seed=2, per_channel=(reset == "zero"), burst=burst)
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2
    res = _sim(g, x)
    q = quantize(g)
    shapes = {p.name: p.shape for p in q.populations}
    shapes[CLOCK] = (1,)
    v_tr = {k: v.numpy().astype(np.int64) for k, v in res.extra["trace"]["v"].items()}
    s_tr = {k: v.numpy() for k, v in res.extra["trace"]["s"].items()}
    vmax = 2**23 - 1
    for p in q.populations:
        if p.static:
            continue
        a = np.zeros((T, 3, p.size), np.int64)
        for c in p.conns:
            w = _dense(c, shapes)
            src = np.ones((T, 3, 1), np.int64) if c.source == CLOCK else s_tr[c.source].reshape(T, 3, -1)
            acc = np.einsum("ij,tbj->tbi", w, src.astype(np.int64))
            a += acc << c.exp if c.exp >= 0 else acc >> -c.exp
        assert np.abs(a).max() <= LOIHI["a_in_max"]
        bias = 0
        if p.bias is not None:  # the layer biases as a bias current: 13-bit mantissa << exp
            val = p.bias * p.neuron_scale()
            exp = np.zeros(p.size, np.int64)
            for k in range(7):
                exp += np.round(np.abs(val) / 2.0**k) > 4095
            mant = np.round(val / 2.0**exp).astype(np.int64)
            assert np.abs(mant).max() <= 4095
            bias = mant << exp
        v = np.full((3, p.size), p.v_init, np.int64)
        for t in range(T):
            v = np.clip(v + (a[t] << 6) + bias, -vmax, vmax)
            if p.role == "readout":
                assert np.array_equal(v, v_tr[p.name][t].reshape(3, -1))
                v = np.zeros_like(v)
                continue
            s = np.clip((v - 1) // (p.vth << 6), 0, burst) if burst > 1 else v > (p.vth << 6)
            assert np.array_equal(s, s_tr[p.name][t].reshape(3, -1)), (p.name, t)
            v = np.where(s, 0, v) if reset == "zero" else v - s * (p.vth << 6)
            assert np.array_equal(v, v_tr[p.name][t].reshape(3, -1)), (p.name, t)
    assert burst == 1 or max(float(s.max()) for s in s_tr.values()) > 1  # graded spikes happened


@pytest.mark.portable
def test_quantisation_stays_within_the_bit_budget():
    q = quantize(small_graph("subtract", seed=3))
    assert q.depth == 4  # n1 0, n2 1, n3 2 (shortcut from n1 delayed by one step), n4 3, readout 4
    delays = {c.name: c.delay for p in q.populations for c in p.conns}
    assert delays["n1->n3"] == 1 and delays["conv3"] == 0
    assert q.population("output").bias is not None and "output.bias" not in delays  # a bias current
    for p in q.populations:
        assert 0 <= p.vth <= LOIHI["vth_max"]
        assert p.report.get("a_in_bound", 0) <= LOIHI["a_in_max"]
        for c in p.conns:
            m = c.mant
            assert LOIHI["weight_exp_min"] <= c.exp <= LOIHI["weight_exp_max"]
            if c.report["sign_mode"] == "mixed":  # Lava keeps even values only
                assert (m % 2 == 0).all() and np.abs(m).max() <= 254
            else:  # single sign, or split into an excitatory and an inhibitory group
                assert np.abs(m).max() <= 255 and (c.report["sign_mode"] == "split") == (m.min() < 0 < m.max())
                assert c.report["sign_mode"] != "split" or c.exp >= 0
            assert c.report["clipped"] == 0
    mixed = quantize(small_graph("subtract", seed=3), split_signs=False)
    modes = {c.report["sign_mode"] for p in mixed.populations for c in p.conns}
    assert "mixed" in modes and "split" not in modes


@pytest.mark.portable
def test_two_weight_groups_refine_the_weights_within_the_budget():
    """weight_groups=2: each connection gains a residual group "<name>.lo" (8-bit mantissas, a
    lower exponent) that makes the summed weights finer; synapses are counted for both."""
    g = small_graph("zero", seed=3)
    one, two = quantize(g), quantize(g, weight_groups=2)
    hi = {c.name: c for p in one.populations for c in p.conns}
    lo = {c.name: c for p in two.populations for c in p.conns if c.name.endswith(".lo")}
    assert lo
    for name, c in lo.items():
        base = hi[name[:-3]]
        assert c.exp < base.exp and np.abs(c.mant).max() <= 255 and c.report["clipped"] == 0
        assert c.report["rel_error"] < base.report["rel_error"] / 8
    for p in two.populations:
        assert p.report.get("a_in_bound", 0) <= LOIHI["a_in_max"]
    from snnconv_backends.loihi2 import resources
    assert resources(two)["synapses"] > resources(one)["synapses"]
    with pytest.raises(BackendError, match="weight_groups"):
        quantize(g, weight_groups=3)
    with pytest.raises(BackendError, match="names no connection.*conv99"):
        quantize(g, weight_groups={"conv99": 2})
    assert len(quantize(g, weight_groups={"conv3": 2}).population("n3").conns) == \
        len(one.population("n3").conns) + 1


@pytest.mark.portable
def test_reports_and_latency():
    g = small_graph("zero", seed=4)
    res = _sim(g, torch.rand(2, 1, 8, 8), T=3)
    q = quantize(g)
    ex = res.extra
    assert ex["latency"]["steps"] == 3 + q.depth
    assert ex["resources"]["neurons"] == sum(p.size for p in q.populations) + 1  # + the clock
    assert ex["resources"]["chips"] == 1
    assert ex["energy"]["per_image_J"] > 0 and ex["energy"]["ann_per_image_J"] > 0
    assert ex["quantisation"]["runtime"]["wrapped"] == 0
    text = format_report(res)
    for word in ("quantisation", "resources", "latency", "energy", "Davies"):
        assert word in text
    assert res.outputs.shape == (3, 2, 3)
    assert set(res.spikes) == {"n1", "n2", "n3", "n4"}


@pytest.mark.portable
def test_bad_input_and_options_are_refused():
    g = small_graph("zero")
    with pytest.raises(BackendError, match="unknown option"):
        Loihi2SimBackend().compile(g, bogus=1)
    with pytest.raises(BackendError, match="weight_bits"):
        Loihi2SimBackend().compile(g, weight_bits=0)
    prog = Loihi2SimBackend().compile(g)
    with pytest.raises(BackendError, match="expected"):
        prog.run(torch.rand(2, 1, 7, 7), 4)
    with pytest.raises(BackendError, match="static batch"):
        prog.run(torch.rand(4, 2, 1, 8, 8), 4)
    with pytest.raises(BackendError, match="T must be"):
        prog.run(torch.rand(2, 1, 8, 8), 0)
    with pytest.raises(BackendError, match="make lava-env"):
        LavaBackend().compile(g, python="/nonexistent/python3.10").run(torch.rand(1, 1, 8, 8), 2)
    with pytest.raises(BackendError, match="unknown option"):
        LavaBackend().compile(g, bits=3)


def test_sim_matches_the_float_snn_up_to_quantisation(trained_digits_cnn, digits_loaders):
    """On a converted digits CNN (pooling between convolutions, per-channel thresholds) the
    8-bit simulator keeps the cpu backend's (float) decisions and each layer's spike counts,
    graded spikes (burst neurons) included."""
    from snnconv.snn.nir_io import export_nir

    train, test = digits_loaders
    x, y = next(iter(test))
    for reset, burst in (("subtract", 1), ("zero", 1), ("subtract", 4)):
        snn, _ = snnconv.convert(copy.deepcopy(trained_digits_cnn), train, T=8, reset=reset,
                                 per_channel=True, progress=False, burst=burst,
                                 finetune_epochs=None if burst == 1 else 0)
        graph = export_nir(snn)
        cpu = snnconv.backends.get("cpu").compile(graph).run(x, 8)
        ref, counts = cpu.outputs, cpu.spikes
        res = Loihi2SimBackend().compile(graph).run(x, 8)
        assert set(res.spikes) == set(counts)
        for name, c in res.spikes.items():
            want = float(counts[name].sum())
            assert abs(float(c.sum()) - want) <= 0.02 * want + 10, (reset, burst, name)
        agree = (ref.mean(0).argmax(1) == res.outputs.mean(0).argmax(1)).float().mean().item()
        assert agree >= (0.95 if reset == "subtract" else 0.75), (reset, agree)
