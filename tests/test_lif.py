"""NIR's leaky neurons (LIF, CubaLIF, LI) on every executor, against trajectories computed by
hand from the spec's equations (forward Euler at dt, from the zero state)::

    LIF      h = v + dt/tau (v_leak - v + r x);               s = h > v_threshold; v = v_reset if s else h
    CubaLIF  i = i + dt/tau_syn (w_in x - i);
             h = v + dt/tau_mem (v_leak - v + r i);           s, v as LIF
    LI       v = v + dt/tau (v_leak - v + r x)                (its output is v)

Every coefficient and input is a short binary fraction, so float32 computes the trajectories
exactly and each backend must reproduce them bit for bit, ties included (a membrane reaching
the threshold exactly does not spike: NIR compares with ``>``).
"""

from __future__ import annotations

import nir
import numpy as np
import pytest
import torch

from snnconv.errors import BackendError, NIRError
from snnconv.nir.reader import parse
from snnconv.snn.nir_io import from_nir
from snnconv_backends.cpu import CPUBackend
from snnconv_backends.gpu import GPUBackend

T = 6
F = np.float32


def _a(*v):
    return np.array(v, F)


def _graph(node, n, name="n"):
    return nir.NIRGraph(nodes={"input": nir.Input(np.array([n])), name: node,
                               "output": nir.Output(np.array([n]))},
                        edges=[("input", name), (name, "output")], type_check=False)


# Three neurons side by side, each row of the table below derived step by step in its comment.
def lif_case(scale_tau=1.0):
    """neuron 0 (the tie): dt/tau = 1/2, r = 1, x = 2, threshold 1, reset 0:
        h = 0 + (0 + 2)/2 = 1 (= threshold: no spike), 1 + (-1 + 2)/2 = 3/2 (spike, v = 0), ...
    neuron 1: dt/tau = 1/4, r = 2, v_leak = 1/2, x = 1, threshold 1, reset -1/2:
        h = 0 + (1/2 + 2)/4 = 5/8, 5/8 + (-1/8 + 2)/4 = 35/32 (spike, v = -1/2),
        -1/2 + (1 + 2)/4 = 1/4, 1/4 + (1/4 + 2)/4 = 13/16, 13/16 + (-5/16 + 2)/4 = 79/64 (spike)
    neuron 2: dt/tau = 1/2, r = 1, v_leak = 3/2, x = -1/2: v -> 1 from below, never above."""
    node = nir.LIF(tau=_a(2, 4, 2) * F(scale_tau), r=_a(1, 2, 1), v_leak=_a(0, 0.5, 1.5),
                   v_threshold=_a(1, 1, 1), v_reset=_a(0, -0.5, 0))
    x = torch.tensor([[2.0, 1.0, -0.5]])
    spikes = [[0, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 0]]
    return node, x, torch.tensor(spikes, dtype=torch.float32).reshape(T, 1, 3)


def cubalif_case():
    """neuron 0 (the tie): dt/tau_syn = dt/tau_mem = 1/2, r = w_in = 1, x = 2, threshold 1:
        i = 1, h = 1/2;  i = 3/2, h = 1/2 + (-1/2 + 3/2)/2 = 1 (tie: no spike);
        i = 7/4, h = 1 + (-1 + 7/4)/2 = 11/8 (spike, v = 0);  i = 15/8, h = 15/16;
        i = 31/16, h = 23/16 (spike);  i = 63/32, h = 63/64
    neuron 1: dt/tau_syn = 1/4, dt/tau_mem = 1/2, r = 2, w_in = 3/2, v_leak = 1/4, x = 1,
    threshold 1, reset -1/4:
        i = 3/8, h = (1/4 + 3/4)/2 = 1/2;  i = 21/32, h = 1/2 + (-1/4 + 21/16)/2 = 33/32 (spike);
        i = 111/128, h = -1/4 + (1/2 + 111/64)/2 = 111/128 (0.867..);  then spikes at 4, 5, 6."""
    node = nir.CubaLIF(tau_syn=_a(2, 4), tau_mem=_a(2, 2), r=_a(1, 2), v_leak=_a(0, 0.25),
                       v_threshold=_a(1, 1), v_reset=_a(0, -0.25), w_in=_a(1, 1.5))
    x = torch.tensor([[2.0, 1.0]])
    spikes = [[0, 0], [0, 1], [1, 0], [0, 1], [1, 1], [0, 1]]
    return node, x, torch.tensor(spikes, dtype=torch.float32).reshape(T, 1, 2)


def li_case():
    """neuron 0: dt/tau = 1/2, r = 1, x = 1: v = 1/2, 3/4, 7/8, ... = 1 - 2**-t.
    neuron 1: dt/tau = 1/4, r = 2, v_leak = 1/2, x = 1: v = 5/8, 5/8 + (-1/8 + 2)/4 = 35/32, ..."""
    node = nir.LI(tau=_a(2, 4), r=_a(1, 2), v_leak=_a(0, 0.5))
    x = torch.tensor([[1.0, 1.0]])
    v = [[0.5, 0.625], [0.75, 1.09375], [0.875, 1.4453125], [0.9375, 1.708984375],
         [0.96875, 1.90673828125], [0.984375, 2.0550537109375]]
    return node, x, torch.tensor(v).reshape(T, 1, 2)


CASES = {"lif": lif_case, "cubalif": cubalif_case, "li": li_case}


def _cpu(g, x, **opts):
    return CPUBackend().compile(g, **opts).run(x, T).outputs


def _gpu_on(device):
    def run(g, x, **opts):
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return GPUBackend().compile(g, device=device, **opts).run(x.to(device), T).outputs.cpu()
    return run


def _from_nir(g, x, **opts):
    with torch.no_grad():
        return from_nir(g, T=T, **opts).run(x)


EXECUTORS = {"cpu": _cpu, "gpu": _gpu_on("cuda"), "gpu-code-on-cpu": _gpu_on("cpu"), "from_nir": _from_nir}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.cuda) if e == "gpu" else e
                                      for e in sorted(EXECUTORS)])
def test_golden_trajectory(kind, executor):
    """Each executor reproduces the hand-computed spikes (LI: membranes) exactly, the tie
    included."""
    node, x, want = CASES[kind]()
    got = EXECUTORS[executor](_graph(node, x.shape[1]), x)
    assert torch.equal(got, want), (got.squeeze(1).tolist(), want.squeeze(1).tolist())


def test_the_tie_does_not_spike_and_the_step_is_the_modules():
    """The step functions themselves: a membrane landing exactly on the threshold stays; the
    torch module with the surrogate (training mode) gives the same forward values."""
    from snnconv.nir.leaky import leaky_params
    from snnconv.snn.neuron import LeakyNeuron, leaky_sequence

    node, x, want = lif_case()
    p = leaky_params(parse(_graph(node, 3)).op("n").params)
    assert torch.equal(leaky_sequence("lif", [x] * T, p), want)
    mod = LeakyNeuron("lif", p, T)
    xs = x.expand(T, 1, 3).reshape(T, 3).clone().requires_grad_(True)
    out = mod(xs)
    assert torch.equal(out.detach().reshape(T, 1, 3), want)
    out.sum().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all() and (xs.grad != 0).any()


@pytest.mark.parametrize("executor", ["cpu", "from_nir"])
def test_dt_is_a_parameter_of_reading(executor):
    """tau written in seconds (1e-4 s steps, as snntorch and norse export) and read with
    dt=1e-4 gives the dt=1 trajectory; read at dt=1 it is refused with the reason."""
    node, x, want = lif_case(scale_tau=1e-4)
    g = _graph(node, 3)
    assert torch.equal(EXECUTORS[executor](g, x, dt=1e-4), want)
    with pytest.raises((NIRError, BackendError), match=r"dt / tau = .* > 1.*dt=1e-4"):
        EXECUTORS[executor](g, x)


def _net(seed=0):
    """input(2, 6, 6) -> conv -> LIF -> flatten -> affine -> CubaLIF -> affine -> LI -> output."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(F)  # noqa: E731
    u = lambda lo, hi, *s: rng.uniform(lo, hi, s).astype(F)  # noqa: E731
    shape = (3, 6, 6)
    nodes = {
        "input": nir.Input(np.array([2, 6, 6])),
        "conv": nir.Conv2d(input_shape=(6, 6), weight=r(3, 2, 3, 3), stride=1, padding=1, dilation=1,
                           groups=1, bias=r(3)),
        "lif": nir.LIF(tau=u(1.5, 8, *shape), r=u(0.5, 2, *shape), v_leak=u(-0.2, 0.2, *shape),
                       v_threshold=u(0.5, 1.5, *shape), v_reset=u(-0.3, 0.1, *shape)),
        "flat": nir.Flatten(start_dim=0, end_dim=-1, input_type={"input": np.array(shape)}),
        "fc1": nir.Affine(weight=r(5, 108) * F(0.3), bias=r(5)),
        "cuba": nir.CubaLIF(tau_syn=u(1, 4, 5), tau_mem=u(1.5, 6, 5), r=u(0.5, 2, 5), v_leak=u(-0.1, 0.1, 5),
                            v_threshold=u(0.3, 1, 5), v_reset=np.zeros(5, F), w_in=u(0.5, 1.5, 5)),
        "fc2": nir.Affine(weight=r(4, 5), bias=r(4)),
        "li": nir.LI(tau=u(1.5, 5, 4), r=np.ones(4, F), v_leak=np.zeros(4, F)),
        "output": nir.Output(np.array([4])),
    }
    order = ["input", "conv", "lif", "flat", "fc1", "cuba", "fc2", "li", "output"]
    return nir.NIRGraph(nodes=nodes, edges=list(zip(order, order[1:])), type_check=False)


def test_cpu_and_from_nir_agree_bit_for_bit_on_a_random_network():
    """Random float weights and per-neuron parameters: the same spikes at every layer and
    the same readout, bit for bit; and every spiking layer spikes (a vacuous check otherwise)."""
    g = _net()
    x = torch.randn(7, 2, 6, 6, generator=torch.Generator().manual_seed(0)) * 2
    res = CPUBackend().compile(g).run(x, T)
    snn = from_nir(g, T=T)
    with torch.no_grad():
        ref, counts = snn.run(x, spike_counts=True)
    assert torch.equal(res.outputs, ref)
    assert set(res.spikes) == {"lif", "cuba"}
    assert all(float(s.sum()) > 0 for s in res.spikes.values())
    assert res.synops["fc1"] > 0 and res.synops["fc2"] > 0


def test_from_nir_trains_with_bptt_through_the_atan_surrogate():
    """Gradients reach every weight, through both spiking layers (the conv before the LIF
    gets a non-zero gradient only through the surrogate), and the training-mode forward
    equals the no-gradient forward."""
    g = _net(seed=1)
    x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(1)) * 2
    snn = from_nir(g, T=T).train()
    out = snn(x)
    with torch.no_grad():
        assert torch.equal(out.detach(), snn(x))
    out.pow(2).sum().backward()
    params = dict(snn.named_parameters())
    assert {n for n in params if n.endswith("weight")} >= {"net.conv.weight", "net.fc1.weight", "net.fc2.weight"}
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert (p.grad != 0).any(), name
    opt = torch.optim.SGD(snn.parameters(), lr=1e-2)
    before = snn(x).pow(2).sum().item()
    opt.step()
    assert snn(x).pow(2).sum().item() != before


@pytest.mark.parametrize("field,value,match", [
    ("tau", _a(2, 0, 2), "tau must be positive"),
    ("tau", _a(2, 0.5, 2), r"dt / tau = 2.0 > 1"),
    ("r", _a(1, 1), "shapes disagree"),
    ("v_threshold", _a(1, np.nan, 1), "NaN/inf"),
])
def test_bad_leaky_parameters_are_refused_by_name(field, value, match):
    node, _, _ = lif_case()
    setattr(node, field, value)
    with pytest.raises(NIRError, match=f"node 'n'.*{match}"):
        parse(_graph(node, 3))


@pytest.mark.parametrize("dt", [0, -1.0, float("nan"), "1"])
def test_a_bad_dt_is_refused(dt):
    node, _, _ = lif_case()
    with pytest.raises(NIRError, match="dt must be a positive"):
        parse(_graph(node, 3), dt=dt)


def test_the_fine_tuning_stage_trains_a_leaky_network_read_from_nir():
    """snnconv.finetune (BPTT through T steps) runs on a from_nir LIF/CubaLIF/LI network and
    changes its weights; the caller's network is left as it was."""
    import snnconv

    snn = from_nir(_net(seed=2), T=4)
    before = {k: v.clone() for k, v in snn.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(48, 2, 6, 6, generator=g) * 2, torch.randint(0, 4, (48,), generator=g)
    tuned, history = snnconv.finetune(snn, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)],
                                      epochs=1, progress=False)
    assert np.isfinite(history[-1]["loss"])
    assert all(torch.equal(v, snn.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(tuned.state_dict()["net.fc1.weight"], before["net.fc1.weight"])


def test_a_leaky_graph_survives_a_file_round_trip(tmp_path):
    """save_nir / load_nir keep every parameter: the same outputs on the cpu backend."""
    from snnconv.snn.nir_io import load_nir, save_nir

    g = _net(seed=3)
    save_nir(g, tmp_path / "leaky.nir")
    back = load_nir(tmp_path / "leaky.nir")
    x = torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_cpu(back, x), _cpu(g, x))


def test_a_file_with_r_equal_to_tau_over_dt_has_an_input_gain_of_exactly_one():
    """snntorch and norse write LIF with tau = dt / (1 - beta) and r = tau / dt: read at their
    dt, the input enters the membrane unscaled (g_in = dt/tau * r is multiplied once, in float64)."""
    dt = 1e-4
    beta = np.linspace(0.05, 0.99, 50)
    tau = dt / (1 - beta)
    node = nir.LIF(tau=tau, r=tau / dt, v_leak=np.zeros(50), v_threshold=np.ones(50), v_reset=np.zeros(50))
    p = parse(_graph(node, 50), dt=dt).op("n").params
    assert (p["g_in"] == 1).all()
    assert np.array_equal(p["k_mem"], (1 - beta).astype(np.float32))


def test_a_sequence_input_drives_the_leaky_neurons_step_by_step():
    """A [T, B, N] input on the cpu backend: LI (dt/tau = 1/2, r = 1) on x = 1, 1, 0, 2, 0, 0:
    v = 1/2, 3/4, 3/8, 19/16, 19/32, 19/64; LIF (threshold 1) on the same: the tie-free
    h = 1/2, 3/4, 3/8, 19/16 (spike, v = 0), 0, 0."""
    x = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.0, 0.0]).reshape(T, 1, 1)
    li = nir.LI(tau=_a(2), r=_a(1), v_leak=_a(0))
    lif = nir.LIF(tau=_a(2), r=_a(1), v_leak=_a(0), v_threshold=_a(1), v_reset=_a(0))
    v = torch.tensor([0.5, 0.75, 0.375, 1.1875, 0.59375, 0.296875]).reshape(T, 1, 1)
    assert torch.equal(_cpu(_graph(li, 1), x), v)
    assert torch.equal(_cpu(_graph(lif, 1), x), torch.tensor([0.0, 0, 0, 1, 0, 0]).reshape(T, 1, 1))
