"""LIF, CubaLIF and LI on Loihi 2: ``loihi2-sim`` and ``lava`` run Lava's own CUBA LIF neuron with
``du``, ``dv`` from ``dt / tau``.

Properties: every backend reproduces the same hand-computed trajectories (ties included; the
LI readout within its documented fixed-point error); Lava and loihi2-sim agree bit for bit on a
random leaky network (skipped only without the .venv-lava side environment); the simulator's
traces satisfy Lava's fixed-point equations recomputed in numpy; the fixed-point error against
the float reference is small; what Lava's neuron cannot run is refused by name.
"""

from __future__ import annotations

import nir
import numpy as np
import pytest
import torch
from _lif_nets import chip_cubalif, chip_li, chip_lif, chip_net, fixed_point_error

import snnconv  # noqa: F401  (imports snnconv_backends in the supported order)
from snnconv.errors import BackendError
from snnconv.nir.reader import parse
from snnconv.snn.nir_io import from_nir
from snnconv_backends.cpu import CPUBackend
from snnconv_backends.gpu import GPUBackend
from snnconv_backends.lava import LavaBackend
from snnconv_backends.loihi2 import CLOCK, LOIHI, Loihi2SimBackend, bias_current, quantize

T = 6
CHIP = {"lif": chip_lif, "cubalif": chip_cubalif, "li": chip_li}


def _lava():
    ok, reason = LavaBackend().availability()
    if not ok:
        pytest.skip(f"Lava side environment missing: {reason}")
    return LavaBackend()


def _chip(backend, kind, g, x, **opts):
    """The neuron's spikes ``[T, N]`` from the trace (LI: the readout)."""
    r = backend.compile(g, **opts).run(x, T) if isinstance(backend, LavaBackend) else \
        backend.compile(g, record=True, **opts).run(x, T)
    return r.outputs.squeeze(1) if kind == "li" else r.extra["trace"]["s"]["n"].reshape(T, -1).float()


def _run(executor, kind, g, x, **opts):
    if executor == "cpu":
        return CPUBackend().compile(g, **opts).run(x, T).outputs.squeeze(1)
    if executor == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return GPUBackend().compile(g, **opts).run(x.cuda(), T).outputs.squeeze(1).cpu()
    if executor == "from_nir":
        with torch.no_grad():
            return from_nir(g, T=T, **opts).run(x).squeeze(1)
    return _chip(_lava() if executor == "lava" else Loihi2SimBackend(), kind, g, x, **opts)


@pytest.mark.parametrize("kind", sorted(CHIP))
@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda), "from_nir",
                                      "loihi2-sim", "lava"])
def test_golden_trajectory_on_every_backend(kind, executor):
    """The hand-computed spikes exactly (every tie stays below threshold); the LI readout
    exactly in float, within 2**-7 of its largest value in fixed point (8-bit weights)."""
    g, x, want = CHIP[kind]()
    got = _run(executor, kind, g, x)
    if kind == "li" and executor in ("loihi2-sim", "lava"):
        assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max()), (got, want)
    else:
        assert torch.equal(got, want), (got.tolist(), want.tolist())


def test_dt_is_a_parameter_of_reading_on_the_chip():
    """tau in seconds read with dt=1e-4: the same decays and the same spikes."""
    g, x, want = chip_lif()
    g.nodes["n"].tau = g.nodes["n"].tau * np.float32(1e-4)
    q = quantize(parse(g, dt=1e-4))
    assert q.population("n").dv == 2048 and q.population("n").du == 4095
    assert torch.equal(_chip(Loihi2SimBackend(), "lif", g, x, dt=1e-4), want)
    with pytest.raises(BackendError, match=r"dt / tau = .* > 1"):
        Loihi2SimBackend().compile(g)


def test_lava_and_sim_agree_bit_for_bit_on_a_random_leaky_network():
    """conv -> LIF -> affine -> CubaLIF -> affine -> LI: every population's v and spikes at
    every step, the readout and the spike counts are identical, and every layer spikes."""
    lava = _lava()
    g = chip_net(seed=3)
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2
    sim = Loihi2SimBackend().compile(g, record=True).run(x, 8)
    ref = lava.compile(g).run(x, 8)
    assert ref.extra["lava"]["idle_before_window"]
    vs, vl = sim.extra["trace"]["v"], ref.extra["trace"]["v"]
    assert set(vs) == set(vl) == {"lif", "cuba", "li"}
    for name in vs:
        assert torch.equal(vs[name].reshape(vl[name].shape), vl[name]), name
    for name, s in sim.extra["trace"]["s"].items():
        assert torch.equal(s.reshape(ref.extra["trace"]["s"][name].shape), ref.extra["trace"]["s"][name]), name
        assert s.any(), f"{name} never spiked: the check would be vacuous"
    assert torch.equal(sim.outputs, ref.outputs)
    assert {k: v.tolist() for k, v in sim.spikes.items()} == {k: v.tolist() for k, v in ref.spikes.items()}


def _dense(c, shapes):
    rows, cols, vals = c.coo(shapes[c.source], shapes[c.target])
    m = np.zeros((int(np.prod(shapes[c.target])), int(np.prod(shapes[c.source]))), np.int64)
    np.add.at(m, (rows, cols), vals.astype(np.int64))
    return m


def _decay(x, d):
    """Lava's ``sign(x) * (|x| * (4096 - d) >> 12)``."""
    return np.sign(x) * ((np.abs(x) * (4096 - d)) >> 12)


def test_sim_follows_lavas_leaky_fixed_point_equations():
    """Recompute each population step by step in numpy int64 from the integer matrices:
    a = sum_k shift(W_k @ s_k, e_k); u = decay(u, du + 1) + (a << 6);
    v = clip24(decay(v, dv) + u + bias); s = v > vth << 6; v = 0 where s."""
    g = chip_net(seed=4)
    B = 3
    x = torch.rand(B, 1, 8, 8, generator=torch.Generator().manual_seed(4)) * 2
    trace = Loihi2SimBackend().compile(g, record=True).run(x, 8).extra["trace"]
    v_tr, s_tr = ({k: v.numpy().astype(np.int64) for k, v in trace[n].items()} for n in ("v", "s"))
    q = quantize(g)
    shapes = {CLOCK: (1,), **{p.name: p.shape for p in q.populations}}
    vmax = 2**23 - 1
    assert {p.name: (p.du, p.dv) for p in q.populations} == {"lif": (4095, 1024), "cuba": (2047, 1024),
                                                              "li": (4095, 1365)}
    conv = q.graph.op("conv")
    z = torch.nn.functional.conv2d(x, torch.from_numpy(np.array(conv.params["weight"])),
                                   torch.from_numpy(np.array(conv.params["bias"])), padding=1)
    for p in q.populations:
        a = np.zeros((8, B, p.size), np.int64)
        bias = 0
        if p.static:
            mant, exp, _ = bias_current(z.reshape(B, -1), p)
            bias = (mant.numpy().astype(np.int64) << exp.numpy().astype(np.int64))
        for c in p.conns:
            w = _dense(c, shapes)
            src = np.ones((8, B, 1), np.int64) if c.source == CLOCK else s_tr[c.source].reshape(8, B, -1)
            acc = np.einsum("ij,tbj->tbi", w, src.astype(np.int64))
            a += acc << c.exp if c.exp >= 0 else acc >> -c.exp
        assert np.abs(a).max() <= LOIHI["a_in_max"]
        u = np.zeros((B, p.size), np.int64)
        v = np.zeros((B, p.size), np.int64)
        for t in range(8):
            u = _decay(u, p.du + 1) + (a[t] << 6)
            assert np.abs(u).max() <= 2**23  # never wraps
            v = np.clip(_decay(v, p.dv) + u + bias, -vmax, vmax)
            if p.role != "readout":
                s = v > (p.vth << 6)
                assert np.array_equal(s, s_tr[p.name][t].reshape(B, -1)), (p.name, t)
                v = np.where(s, 0, v)
            assert np.array_equal(v, v_tr[p.name][t].reshape(B, -1)), (p.name, t)


def test_fixed_point_error_against_the_float_reference_is_small():
    """On a random network (256 images, T = 8): nearly every spike of loihi2-sim is the float
    network's (the first layer's input is a 13-bit bias current, the later ones 8-bit weights),
    no current wraps and no membrane saturates, and the readout's argmax mostly agrees."""
    e = fixed_point_error(seed=0)
    assert e["lif"]["agree"] >= 0.999 and e["cuba"]["agree"] >= 0.98
    assert e["cuba"]["rate_float"] > 0.01
    assert e["li"]["argmax_agree"] >= 0.95
    assert e["runtime"]["wrapped"] == 0 and e["runtime"]["saturated"] == 0


def test_decays_are_rounded_to_4096ths_and_reported():
    """tau = 3 dt: dv = round(4096 / 3) = 1365, its rounding in the population's report."""
    g = chip_net(seed=0)
    li = quantize(g).population("li")
    assert li.dv == 1365 and li.report["decay_error_v"] == pytest.approx(1365 / 4096 - 1 / 3, abs=1e-7)


def _edit(graph_fn, node, **fields):
    g, x, _ = graph_fn()
    for k, v in fields.items():
        setattr(g.nodes[node], k, v)
    return g, x


@pytest.mark.parametrize("make, match", [
    (lambda: _edit(chip_lif, "n", v_leak=np.full(4, 0.1, np.float32)), "'n': v_leak != 0"),
    (lambda: _edit(chip_lif, "n", v_reset=np.full(4, -0.5, np.float32)), "'n': v_reset != 0"),
    (lambda: _edit(chip_lif, "n", tau=np.array([2, 2, 4, 2], np.float32)), "'n': dt / tau differs within the layer"),
    (lambda: _edit(chip_lif, "n", r=np.array([1, -1, 1, 1], np.float32)), "'n': r must be positive"),
    (lambda: _edit(chip_lif, "n", tau=np.full(4, 9000, np.float32)), "below Loihi's decay resolution"),
    (lambda: _edit(chip_cubalif, "src", tau=np.array([2], np.float32)), None),
])
def test_what_lavas_neuron_cannot_run_is_refused_by_name(make, match):
    g, _ = make()
    if match is None:  # the unchanged graph compiles: the refusals are about the field changed
        Loihi2SimBackend().compile(g)
        return
    with pytest.raises(BackendError, match=match):
        Loihi2SimBackend().compile(g)


def test_structures_the_chip_cannot_run_are_refused_by_name():
    """A CubaLIF fed by the static input (its input would skip the synaptic current) unless
    tau_syn = dt, an LI that is not the readout, and a layer whose r varies within a channel."""
    F = np.float32
    cuba = nir.CubaLIF(tau_syn=np.full(2, 2, F), tau_mem=np.full(2, 2, F), r=np.ones(2, F), v_leak=np.zeros(2, F),
                       v_threshold=np.ones(2, F), v_reset=np.zeros(2, F), w_in=np.ones(2, F))
    g = nir.NIRGraph(nodes={"input": nir.Input(np.array([2])), "c": cuba, "output": nir.Output(np.array([2]))},
                     edges=[("input", "c"), ("c", "output")], type_check=False)
    with pytest.raises(BackendError, match="CubaLIF 'c' is fed by the static first layer.*tau_syn = dt"):
        Loihi2SimBackend().compile(g)
    cuba.tau_syn = np.ones(2, F)  # tau_syn = dt: exact
    Loihi2SimBackend().compile(g)
    g, _, _ = chip_li()
    g.nodes["li2"] = nir.LIF(tau=np.full(2, 2, F), r=np.ones(2, F), v_leak=np.zeros(2, F),
                             v_threshold=np.ones(2, F), v_reset=np.zeros(2, F))
    g.edges = [e for e in g.edges if e != ("n", "output")] + [("n", "li2"), ("li2", "output")]
    with pytest.raises(BackendError, match="LI node 'n' feeds other layers"):
        Loihi2SimBackend().compile(g)
    g = chip_net(seed=0)
    r = np.array(g.nodes["lif"].r)
    r[0, 0, 0] += 0.5
    g.nodes["lif"].r = r
    with pytest.raises(BackendError, match="'lif': r varies within a channel"):
        Loihi2SimBackend().compile(g)
