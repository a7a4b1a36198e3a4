"""Execution of a quantised network: the off-chip encoder, the first layer's bias currents, and
the batched, bit-exact neuron and synapse updates (:func:`run_quantized`)."""

from __future__ import annotations

from typing import Any, Mapping, cast

import numpy as np
import torch

from snnconv_backends.loihi2.chip import LOIHI
from snnconv_backends.loihi2.network import Connection, Population, QuantizedNetwork
from snnconv_backends.loihi2.ops import apply_op, convolve

__all__ = ["static_eval", "static_input", "bias_current", "RuntimeCounters", "run_quantized", "connection_synops"]

_V_MAX = 2 ** (LOIHI["uv_bits"] - 1)  # 2**23


def static_eval(q: QuantizedNetwork, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float32 values of the static ops (the off-chip encoder) on a batch ``x``."""
    g = q.graph
    vals: dict[str, torch.Tensor] = {g.ops[0].name: x}
    for op in q.static_ops:
        inp: Any = None
        for i in op.inputs:
            inp = vals[i] if inp is None else inp + vals[i]
        vals[op.name] = apply_op(op, inp.reshape(inp.shape[0], *op.in_shape), bias=True)
    return vals


def static_input(q: QuantizedNetwork, p: Population, vals: dict[str, torch.Tensor], B: int) -> torch.Tensor:
    """The float input ``[B, N]`` that enters population ``p`` as its bias current: its whole
    input for the first layer (the static values ``vals``); for a later population its static
    terms (float64) plus its layer biases (:attr:`Population.bias`)."""
    z: Any = None
    if p.static:
        for i in q.graph.op(p.name).inputs:
            z = vals[i] if z is None else z + vals[i]
        return z.reshape(B, -1)
    for chain in p.late_static:
        y = vals[chain[0].name]
        for op in chain[1:]:
            y = apply_op(op, y.reshape(B, *op.in_shape), bias=False)
        z = y if z is None else z + y
    if p.bias is not None:
        b = torch.as_tensor(p.bias, dtype=torch.float64, device=vals[q.graph.ops[0].name].device)
        z = b.reshape(1, -1).expand(B, -1) if z is None else z.reshape(B, -1).double() + b
    return z.reshape(B, -1)


def bias_current(z: torch.Tensor, pop: Population) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Bias input ``z`` ``[B, N]`` (float, :func:`static_input`) -> (bias mantissa, bias
    exponent, clipped count).

    ``v`` units: ``round(z * scale) = mant << exp``, ``|mant| <= 4095``, ``0 <= exp <= 7`` chosen
    per neuron. Values beyond ``4095 << 7`` are clipped: on the first layer (about twice the
    threshold) a static input of at least one threshold makes the neuron spike at every step
    in both reset modes, so the clipping leaves the spikes unchanged; later layers' thresholds
    are chosen so that their biases fit (:func:`~snnconv_backends.loihi2.quantize`). Counted.
    """
    s = torch.as_tensor(pop.neuron_scale(), dtype=torch.float64, device=z.device)
    val = z.double() * s
    mmax, emax = LOIHI["bias_mant_max"], LOIHI["bias_exp_max"]
    mag = val.abs()
    exp = torch.zeros_like(val, dtype=torch.int32)
    for k in range(emax):  # the smallest exponent whose rounded mantissa fits
        exp += (torch.round(mag * 2.0**-k) > mmax).to(torch.int32)
    mant = torch.round(torch.ldexp(val, -exp.double()))
    clipped = int((mant.abs() > mmax).sum())
    mant = mant.clamp(-mmax, mmax).to(torch.int32)
    return mant, exp, clipped


# Execution runs on float32 tensors holding integers: every value is an integer of magnitude
# below 2**24 (|v| < 2**23, |u| <= 2**21, partial synaptic sums <= 2**23 by the compile-time
# bound), so float32 arithmetic is exact, and faster than integer tensors on CPUs.


def _shift(a: torch.Tensor, e: int) -> torch.Tensor:
    """``a << e`` (``e >= 0``) or the arithmetic ``a >> -e`` (a floor), on integer-valued floats."""
    if e > 0:
        return a * float(2**e)
    if e < 0:
        return torch.floor(a * 2.0**e)
    return a


def _exact(y: torch.Tensor, recompute) -> torch.Tensor:
    """Guard against a library algorithm that is not exact on integers (Winograd, FFT): if the
    first rows of ``y`` are not integral, everything is recomputed in float64 and rounded."""
    head = y[:64]
    if head.numel() and bool((head != torch.round(head)).any()):
        return torch.round(recompute()).to(y.dtype)
    return y


class RuntimeCounters:
    """Saturations, wraps and clipped first-layer biases counted during a run, and the spikes of
    every step (an early exit's counts stop at each image's exit; the fidelity check reads these)."""

    def __init__(self):
        self.saturated = 0
        self.wrapped = 0
        self.bias_clipped = 0
        self.spikes_all_steps: dict[str, torch.Tensor] = {}  # per population [T], past any exit too


def _apply_conn(c: Connection, s: torch.Tensor, src_shape, tgt_shape, cache: dict) -> torch.Tensor:
    """The current ``u = a << 6`` of connection ``c`` (``a = (W s) << e``, a floor for
    ``e < 0``) for spikes ``s`` ``[TB, *src_shape]`` (0/1 float32) -> ``[TB, N]``.

    For ``e >= 0`` the shifts are folded into the weights (``m * 2**(e + 6)``; every partial sum
    stays below ``2**21``); for ``e < 0`` the floor must see the whole sum.
    """
    TB = s.shape[0]
    key = (c.name, c.target, s.device)
    fold = c.exp >= 0
    if key not in cache:
        m = c.mant.astype(np.float64) * (2.0 ** (c.exp + LOIHI["act_shift"]) if fold else 1.0)
        if c.kind == "matrix":
            cache[key] = torch.as_tensor(m.T, dtype=torch.float32, device=s.device).contiguous()
        else:
            cache[key] = torch.as_tensor(m, dtype=torch.float32, device=s.device)
    w = cache[key]
    if c.kind == "conv":
        conv = cast(Mapping[str, Any], c.conv)  # a convolution connection holds its parameters
        y = _exact(convolve(s, w, conv), lambda: convolve(s.double(), w.double(), conv))
    elif c.kind == "matrix":
        flat = s.reshape(TB, -1)
        y = _exact(flat @ w, lambda: flat.double() @ w.double())
    else:  # diag
        y = s.reshape(TB, -1) * w
    y = y.reshape(TB, -1)
    if fold:
        return y
    return torch.floor(y * 2.0**c.exp).mul_(float(2 ** LOIHI["act_shift"]))


def _neuron_loop(pop: Population, a_in: torch.Tensor | None, bias: torch.Tensor | None, T: int,
                 B: int, stats: RuntimeCounters, record: bool):
    """Run ``T`` steps of ``pop``: returns (spikes ``[T, B, N]`` float32 0/1, or the counts
    0..burst of a burst population, voltages int32 or None). ``a_in``: the current
    ``u = a_in << 6``, ``[T*B, N]`` integer-valued float32;
    ``bias``: ``[B, N]``."""
    n = pop.size
    dev = cast(torch.Tensor, a_in if a_in is not None else bias).device
    if pop.leaky:
        return _leaky_loop(pop, a_in, bias, T, B, stats, record)
    if a_in is None:
        u = torch.zeros(T, B, n, dtype=torch.float32, device=dev)
    else:
        u = a_in.reshape(T, B, n)
        bound = pop.report.get("a_in_bound")
        if bound is None or (bound + 1) << LOIHI["act_shift"] > _V_MAX:
            # Lava's wrap of the 24-bit current (AbstractPyLifModelFixed.subthr_dynamics); the
            # compile-time bound makes this unreachable for networks made by quantize()
            ui = u.to(torch.int64)
            over, under = ui > _V_MAX, ui <= -_V_MAX
            stats.wrapped += int(over.sum() + under.sum())
            w = torch.where(over, ui - 2 * _V_MAX, ui)
            u = torch.where(w <= -_V_MAX, ui + 2 * _V_MAX, w).to(torch.float32)
    if bias is not None:
        u = u + bias.reshape(1, B, n).to(torch.float32)
    lo, hi = float(-_V_MAX + 1), float(_V_MAX - 1)
    if pop.role == "readout":
        v = u.clamp(lo, hi)
        stats.saturated += int((v != u).sum())
        return None, v.to(torch.int32)
    vth: Any
    if np.ndim(pop.vth):
        vth = torch.as_tensor(pop.neuron_vth() << LOIHI["vth_shift"], dtype=torch.float32, device=dev)
    else:
        vth = float(pop.vth << LOIHI["vth_shift"])
    if isinstance(pop.v_init, np.ndarray):
        v = torch.as_tensor(pop.v_init, dtype=torch.float32, device=dev).expand(B, n).clone()
    else:
        v = torch.full((B, n), float(pop.v_init), dtype=torch.float32, device=dev)
    spikes = torch.empty(T, B, n, dtype=torch.float32, device=dev)
    volts = torch.empty(T, B, n, dtype=torch.int32, device=dev) if record else None
    hard = pop.reset == "zero"
    if pop.burst > 1:
        vth_i = vth.to(torch.int64) if isinstance(vth, torch.Tensor) else int(vth)
        counts = torch.empty(B, n, dtype=torch.int64, device=dev)
    for t in range(T):
        v.add_(u[t])
        vmin, vmax = torch.aminmax(v)
        if float(vmin) < lo or float(vmax) > hi:  # 24-bit saturation (rare): clip and count
            stats.saturated += int(((v < lo) | (v > hi)).sum())
            v.clamp_(lo, hi)
        if pop.burst > 1:  # a graded spike: the count of k in 1..B with v > k * vth, exact on int64
            torch.clamp(torch.div(v.to(torch.int64) - 1, vth_i, rounding_mode="floor"), 0, pop.burst,
                        out=counts)
            spikes[t].copy_(counts)
        else:
            torch.gt(v, vth, out=spikes[t])
        if hard:  # v - v * s: exact on integer-valued floats (s is 0 or 1)
            v.addcmul_(v, spikes[t], value=-1.0)
        elif np.ndim(pop.vth):
            v.addcmul_(spikes[t], vth, value=-1.0)
        else:
            v.sub_(spikes[t], alpha=vth)
        if volts is not None:
            volts[t] = v.to(torch.int32)
    return spikes, volts


def _decay(x: torch.Tensor, d: int) -> torch.Tensor:
    """Lava's decay ``sign(x) * (|x| * (4096 - d) >> 12)`` on int64 (a truncating division)."""
    return torch.div(x * (4096 - d), 4096, rounding_mode="trunc")


def _leaky_loop(pop: Population, a_in: torch.Tensor | None, bias: torch.Tensor | None, T: int,
                B: int, stats: RuntimeCounters, record: bool):
    """:func:`_neuron_loop` of a leaky population (Lava's LIF with ``du``, ``dv``; the readout
    does not spike), step by step on int64:
    ``u = wrap24(decay(u, du + 1) + (a_in << 6)); v = clip24(decay(v, dv) + u + bias)``."""
    n = pop.size
    dev = cast(torch.Tensor, a_in if a_in is not None else bias).device
    u_in = None if a_in is None else a_in.reshape(T, B, n).to(torch.int64)
    b = torch.zeros((), dtype=torch.int64, device=dev) if bias is None else bias.reshape(B, n).to(torch.int64)
    u = torch.zeros(B, n, dtype=torch.int64, device=dev)
    v = torch.zeros(B, n, dtype=torch.int64, device=dev)
    lo, hi = -_V_MAX + 1, _V_MAX - 1
    vth: Any = pop.vth << LOIHI["vth_shift"]
    readout = pop.role == "readout"
    spikes = None if readout else torch.empty(T, B, n, dtype=torch.float32, device=dev)
    volts = torch.empty(T, B, n, dtype=torch.int32, device=dev) if (record or readout) else None
    for t in range(T):
        d = _decay(u, pop.du + 1) + (0 if u_in is None else u_in[t])
        w = torch.where(d > _V_MAX, d - 2 * _V_MAX, d)  # Lava's wrap of the 24-bit current
        u = torch.where(w <= -_V_MAX, d + 2 * _V_MAX, w)
        stats.wrapped += int((u != d).sum())
        h = _decay(v, pop.dv) + u + b
        v = h.clamp(lo, hi)
        stats.saturated += int((v != h).sum())
        if spikes is not None:  # (not the readout)
            s = v > vth
            spikes[t] = s
            v = torch.where(s, torch.zeros_like(v), v)
        if volts is not None:
            volts[t] = v.to(torch.int32)
    return spikes, volts


def run_quantized(q: QuantizedNetwork, x: torch.Tensor, T: int, *, record: bool = False,
                  exit_rule: Any = None):
    """Run ``q`` on a static batch ``x`` ``[B, *input_shape]`` for ``T`` steps of every layer.

    Returns ``(outputs [T, B, *out_shape], counts {pop: [T]}, spikes {pop: [T, B, N]} and
    voltages {pop: [T, B, N]} (both only with ``record``), stats, synops {connection: float},
    steps [B])``. Times are each population's own steps: the population at depth d runs them at
    chip steps d+1 .. d+T; before, it holds its initial state (no input has arrived).

    ``steps`` is each image's last step: T, or with ``exit_rule`` (an
    :class:`snnconv.exit_rule.ExitRule`) the step at which the rule met its readout. Spike
    counts and synaptic operations then count each image's steps up to that one only (what a
    chip that stops the image there spends); the outputs still hold all T steps.
    """
    B = x.shape[0]
    vals = static_eval(q, x.float())
    spikes: dict[str, torch.Tensor] = {}
    volts: dict[str, torch.Tensor] = {}
    stats = RuntimeCounters()
    per_step: dict[str, torch.Tensor] = {}    # per connection: synaptic operations [T, B]
    by_image: dict[str, torch.Tensor] = {}    # per population: spikes [T, B]
    cache: dict = {}
    left: dict[str, int] = {}
    for p in q.populations:
        for c in p.conns:
            left[c.source] = left.get(c.source, 0) + 1
    shapes = {p.name: p.shape for p in q.populations}
    for p in q.populations:
        bias = a_in = None
        if p.has_bias:
            mant, exp, clipped = bias_current(static_input(q, p, vals, B), p)
            stats.bias_clipped += clipped
            bias = mant << exp
        for c in p.conns:
            if c.kind == "bias":
                a = _shift(torch.as_tensor(c.mant, dtype=torch.float32, device=x.device), c.exp)
                a = (a * float(2 ** LOIHI["act_shift"])).reshape(1, -1).expand(T * B, -1)
                per_step[c.name] = torch.full((T, B), float(c.fanout.sum()), dtype=torch.float64,
                                              device=x.device)
            else:
                src = spikes[c.source]
                a = _apply_conn(c, src.reshape(T * B, *shapes[c.source]), shapes[c.source],
                                p.shape, cache)
                per_step[c.name] = _synops_by_step(c, src.reshape(T, B, -1))
                left[c.source] -= 1
                if left[c.source] == 0 and not record:
                    del spikes[c.source]
            a_in = a if a_in is None else a_in + a
        s, v = _neuron_loop(p, a_in, bias, T, B, stats, record)
        if s is not None:
            spikes[p.name] = s
            by_image[p.name] = s.reshape(T, B, -1).sum(-1, dtype=torch.float64)
        if v is not None:
            volts[p.name] = v
    r = q.readout
    out = volts[r.name].double() / torch.as_tensor(r.membrane_scale(), dtype=torch.float64,
                                                   device=x.device)
    out = out.float().reshape(T, B, *q.graph.output_shape)
    steps = torch.full((B,), T, dtype=torch.long, device=x.device)
    if exit_rule is not None:
        steps = exit_rule.exit_steps(out.reshape(T, B, -1)).to(x.device)
    ran = (torch.arange(T, device=x.device).view(T, 1) < steps.view(1, B)).double()  # [T, B]
    counts = {k: (v * ran).sum(1) for k, v in by_image.items()}
    stats.spikes_all_steps = {k: v.sum(1) for k, v in by_image.items()}
    synops = {k: float((v * ran).sum()) for k, v in per_step.items()}
    if not record:
        spikes, volts = {}, {}
    return out, counts, spikes, volts, stats, synops, steps


def _synops_by_step(c: Connection, spikes: torch.Tensor) -> torch.Tensor:
    """Synaptic operations of ``c`` at each step and image (``[T, B]``) from its source's spikes
    ``[T, B, N_source]`` (graded counts for a burst source)."""
    f = torch.as_tensor(c.fanout, dtype=torch.float64, device=spikes.device).reshape(-1)
    return spikes.double() @ f


def connection_synops(c: Connection, per_neuron: torch.Tensor) -> float:
    """Synaptic operations of ``c`` given its source's spike count per neuron ``[N_source]``."""
    f = torch.as_tensor(c.fanout, dtype=torch.float64, device=per_neuron.device)
    return float((per_neuron.reshape(-1).double() * f).sum())
