"""NIR graphs of leaky neurons that Loihi 2 runs (one time constant per layer, no leak
potential, reset to 0) for the LIF tests, and the fixed-point error of loihi2-sim against the
float reference on a random one (``python tests/_lif_nets.py``)."""

from __future__ import annotations

import nir
import numpy as np
import torch

__all__ = ["chip_lif", "chip_cubalif", "chip_li", "chip_net", "fixed_point_error"]

F = np.float32


def _a(*v):
    return np.array(v, F)


def _zeros(n):
    return np.zeros(n, F)


def chip_lif():
    """input(4) -> LIF -> output; dt/tau = 1/2 everywhere; spikes derived by hand:
    n0: r = 1, threshold 1, x = 2: h = 1 (tie: no spike), 3/2 (spike, v = 0), 1, 3/2, ...
    n1: r = 1, threshold 2, x = 4: h = 2 (tie), 3 (spike), 2, 3, ...
    n2: x = -1: h = -1/2, -3/4, ... never spikes
    n3: r = 1, threshold 1, x = 5/4: h = 5/8, 15/16, 35/32 (spike), 5/8, 15/16, 35/32 (spike)"""
    node = nir.LIF(tau=_a(2, 2, 2, 2), r=_a(1, 1, 1, 1), v_leak=_zeros(4), v_threshold=_a(1, 2, 1, 1),
                   v_reset=_zeros(4))
    g = nir.NIRGraph(nodes={"input": nir.Input(np.array([4])), "n": node, "output": nir.Output(np.array([4]))},
                     edges=[("input", "n"), ("n", "output")], type_check=False)
    spikes = [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]]
    return g, torch.tensor([[2.0, 4.0, -1.0, 1.25]]), torch.tensor(spikes, dtype=torch.float32)


def _after_source(node, w):
    """input(1) -> src -> affine(w) -> node -> output, where src (the LIF tie neuron of
    :func:`chip_lif` on x = 2) spikes at steps 2, 4, 6: the affine delivers 0, w, 0, w, 0, w."""
    src = nir.LIF(tau=_a(2), r=_a(1), v_leak=_a(0), v_threshold=_a(1), v_reset=_a(0))
    n = w.shape[0]
    g = nir.NIRGraph(nodes={"input": nir.Input(np.array([1])), "src": src,
                            "fc": nir.Affine(weight=w.reshape(n, 1), bias=_zeros(n)), "n": node,
                            "output": nir.Output(np.array([n]))},
                     edges=[("input", "src"), ("src", "fc"), ("fc", "n"), ("n", "output")], type_check=False)
    return g, torch.tensor([[2.0]])


def chip_cubalif():
    """... -> CubaLIF (dt/tau_syn = dt/tau_mem = 1/2, r = w_in = 1) -> output, inputs
    x = 0, 2, 0, 2, 0, 2 (n0, threshold 1/2) and half of it (n1, threshold 1/4):
        i = 0, 1, 1/2, 5/4, 5/8, 21/16;  h = 0, 1/2 (tie), 1/2 (tie), 7/8 (spike, v = 0),
        5/16, 13/16 (spike); n1 is n0 halved: the same spikes at half the threshold."""
    node = nir.CubaLIF(tau_syn=_a(2, 2), tau_mem=_a(2, 2), r=_a(1, 1), v_leak=_zeros(2),
                       v_threshold=_a(0.5, 0.25), v_reset=_zeros(2), w_in=_a(1, 1))
    g, x = _after_source(node, _a(2, 1))
    spikes = [[0, 0], [0, 0], [0, 0], [1, 1], [0, 0], [1, 1]]
    return g, x, torch.tensor(spikes, dtype=torch.float32)


def chip_li():
    """... -> LI (dt/tau = 1/2, r = 1) -> output, inputs 0, 2, 0, 2, 0, 2 (n0) and half (n1):
    v = 0, 1, 1/2, 5/4, 5/8, 21/16 (n0) and half of it (n1)."""
    node = nir.LI(tau=_a(2, 2), r=_a(1, 1), v_leak=_zeros(2))
    g, x = _after_source(node, _a(2, 1))
    v = torch.tensor([0, 1, 0.5, 1.25, 0.625, 1.3125])
    return g, x, torch.stack([v, v / 2], 1)


def chip_net(seed: int = 0, C: int = 4, S: int = 8, hidden: int = 12, classes: int = 3) -> nir.NIRGraph:
    """input (1, S, S) -> conv -> LIF -> flatten -> affine -> CubaLIF -> affine -> LI -> output,
    random weights, per-channel thresholds and resistances, one time constant per layer."""
    rng = np.random.default_rng(seed)
    shape = (C, S, S)

    def per_channel(lo, hi):
        return np.broadcast_to(rng.uniform(lo, hi, (C, 1, 1)), shape).astype(F).copy()

    def full(v, s):
        return np.full(s, v, F)

    nodes = {
        "input": nir.Input(np.array([1, S, S])),
        "conv": nir.Conv2d(input_shape=(S, S), weight=(rng.standard_normal((C, 1, 3, 3)) * 0.6).astype(F),
                           stride=1, padding=1, dilation=1, groups=1, bias=(rng.standard_normal(C) * 0.1).astype(F)),
        "lif": nir.LIF(tau=full(4, shape), r=per_channel(0.8, 1.5), v_leak=full(0, shape),
                       v_threshold=per_channel(0.3, 0.6), v_reset=full(0, shape)),
        "flat": nir.Flatten(start_dim=0, end_dim=-1, input_type={"input": np.array(shape)}),
        "fc1": nir.Affine(weight=(rng.standard_normal((hidden, C * S * S)) * 0.3).astype(F),
                          bias=(rng.standard_normal(hidden) * 0.05).astype(F)),
        "cuba": nir.CubaLIF(tau_syn=full(2, hidden), tau_mem=full(4, hidden),
                            r=rng.uniform(0.8, 1.5, hidden).astype(F), v_leak=full(0, hidden),
                            v_threshold=rng.uniform(0.3, 0.6, hidden).astype(F), v_reset=full(0, hidden),
                            w_in=rng.uniform(0.8, 1.2, hidden).astype(F)),
        "fc2": nir.Affine(weight=rng.standard_normal((classes, hidden)).astype(F),
                          bias=(rng.standard_normal(classes) * 0.1).astype(F)),
        "li": nir.LI(tau=full(3, classes), r=full(1, classes), v_leak=full(0, classes)),
        "output": nir.Output(np.array([classes])),
    }
    order = ["input", "conv", "lif", "flat", "fc1", "cuba", "fc2", "li", "output"]
    return nir.NIRGraph(nodes=nodes, edges=list(zip(order, order[1:])), type_check=False)


def fixed_point_error(seed: int = 0, batch: int = 256, T: int = 8) -> dict:
    """loihi2-sim against the float reference (from_nir, = cpu bit for bit) on :func:`chip_net`:
    per spiking layer the share of (step, image, neuron) spikes that agree and both spike
    rates; the LI readout's mean and max absolute error and the share of images whose
    time-averaged readout has the same argmax."""
    from snnconv.snn.nir_io import from_nir
    from snnconv_backends.loihi2 import Loihi2SimBackend

    g = chip_net(seed)
    x = torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2
    snn = from_nir(g, T=T)
    snn.chunk_size = 0
    rec: dict = {}
    for n in ("lif", "cuba"):
        getattr(snn.net, n).register_forward_hook(
            lambda m, i, o, n=n: rec.__setitem__(n, o.detach().reshape(T, batch, -1)))
    with torch.no_grad():
        ref = snn.run(x)
    sim = Loihi2SimBackend().compile(g, record=True).run(x, T)
    out = {}
    for n in ("lif", "cuba"):
        s = sim.extra["trace"]["s"][n].reshape(T, batch, -1).float()
        out[n] = {"agree": float((s == rec[n]).float().mean()), "rate_float": float(rec[n].mean()),
                  "rate_sim": float(s.mean())}
    err = (sim.outputs - ref).abs()
    out["li"] = {"mean_abs_err": float(err.mean()), "max_abs_err": float(err.max()),
                 "max_abs_value": float(ref.abs().max()),
                 "argmax_agree": float((sim.outputs.mean(0).argmax(1) == ref.mean(0).argmax(1)).float().mean())}
    out["runtime"] = sim.extra["quantisation"]["runtime"]
    return out


if __name__ == "__main__":
    import json

    for seed in (0, 1, 2):
        print(seed, json.dumps(fixed_point_error(seed)))
