"""Quantisation: thresholds, weight mantissas and exponents within Loihi's bit budget
(:func:`quantize`, the compile step of ``loihi2-sim`` and ``lava``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from snnconv.errors import BackendError
from snnconv.nir.leaky import SPIKING
from snnconv.nir.reader import ParsedGraph
from snnconv_backends.loihi2.chip import CLOCK, FIRST_VTH, LOIHI
from snnconv_backends.loihi2.leaky import LeakySpec, leaky_spec
from snnconv_backends.loihi2.mapping import Mapper, chain_as_conv, chain_kind, compose, fanout
from snnconv_backends.loihi2.network import Connection, Population, QuantizedNetwork, per_neuron_values
from snnconv_backends.loihi2.ops import conv_params
from snnconv_backends.registry import parse_graph

__all__ = ["quantize"]

_VTH_CAP = 2**16  # vth << 6 <= 2**22: headroom above the threshold
#: A population whose one threshold would be below this gets one threshold per channel.
_VTH_PER_CHANNEL = 2**10
#: Neurons that sum a static input with spikes: the bias current reaches 4095 << 7 = 2**19 -
#: 128 v units, four thresholds at vth = 2**11 (the first layer's FIRST_VTH reaches two).
_LATE_STATIC_VTH = 2**11
#: The largest bias current (``v`` units) a layer's biases may reach: 13-bit mantissa << 7,
#: with a margin for float rounding. A population's threshold is lowered until its biases fit.
_BIAS_MAX = ((LOIHI["bias_mant_max"] << LOIHI["bias_exp_max"]) * 255) // 256


def _quantize_weights(scaled: np.ndarray, bias: bool, bits: int = 8, split: bool = False,
                      mse_exp: bool = False) -> tuple[np.ndarray, int, dict[str, Any]]:
    """Float weights in ``a_in`` units -> (``bits``-bit mantissas, exponent, report).

    Mixed-sign weights keep even mantissas in ``[-2**bits + 2, 2**bits - 2]`` (Lava's mixed
    sign mode drops the lowest bit), single-sign ones ``[0, 2**bits - 1]`` (or negated). With
    ``split``, mixed-sign weights become two single-sign synapse groups with one exponent
    (``sign_mode="split"``): every mantissa in ``[-2**bits + 1, 2**bits - 1]``, twice as fine;
    only where that exponent is >= 0 (a negative one floors each group's sum separately).
    ``mse_exp``: also try the two exponents below the one that fits the largest weight, clipping
    the weights beyond the mantissa range, and keep the one with the least squared error.
    """
    amax = float(np.abs(scaled).max()) if scaled.size else 0.0
    mixed = scaled.size > 0 and scaled.min() < 0 < scaled.max()
    if amax == 0.0:
        return np.zeros(scaled.shape, np.int32), 0, {"exp": 0, "mant_max": 0, "bits": 0, "sign_mode": "excitatory",
                                                     "zero_rounded": 0, "rel_error": 0.0, "clipped": 0}
    if mixed and split and _weight_exp(amax, False, bias, bits) < 0:
        split = False
    halve = mixed and not split  # Lava's mixed sign mode: even mantissas
    lim = 2**bits - 2 if halve else 2**bits - 1
    lowest = LOIHI["weight_exp_min"] - max(0, bits - 8)
    if bias or (split and mixed):  # no negative exponent (see above)
        lowest = max(lowest, 0)
    # weights below the finest step of the range round at that step (to zero, mostly: flushed)
    e0 = max(_weight_exp(amax, halve, bias, bits), lowest)
    best = None
    # the exponent that fits the largest weight, or one or two below it where clipping the
    # few largest weights costs less squared error than the coarser step saves (outliers)
    for e in range(e0, e0 - (3 if mse_exp else 1), -1):
        if e < lowest:
            break
        x = scaled / 2.0**e
        m = 2.0 * np.round(x / 2.0) if halve else np.round(x)
        clipped = int((np.abs(m) > lim).sum())
        m = np.clip(m, -lim, lim).astype(np.int32)
        sse = float(((m.astype(np.float64) * 2.0**e - scaled) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, e, m, clipped)
    assert best is not None  # the exponents tried are never empty
    sse, e, m, clipped = best
    err = float(np.sqrt(sse / max((scaled**2).sum(), 1e-300)))
    sign = ("split" if split else "mixed") if mixed else ("inhibitory" if scaled.max() <= 0 else "excitatory")
    return m, e, {"exp": e, "mant_max": int(np.abs(m).max()), "bits": int(np.abs(m).max()).bit_length(),
                  "sign_mode": sign, "zero_rounded": int(((m == 0) & (scaled != 0)).sum()),
                  "rel_error": err, "clipped": clipped}


def _weight_exp(amax: float, mixed: bool, bias: bool, bits: int) -> int:
    """The exponent of a connection whose largest weight is ``amax`` (``a_in`` units, > 0): the
    smallest that fits its mantissa in ``bits`` bits, within Loihi's exponent range."""
    lim = 2**bits - 2 if mixed else 2**bits - 1
    e = math.ceil(math.log2(amax / lim))
    e = min(max(e, LOIHI["weight_exp_min"] - max(0, bits - 8)), LOIHI["weight_exp_max"])
    return max(e, 0) if bias else e  # a bias has a single input: a negative exponent only drops bits


def _best_vth(vth_max: int, conns: Sequence[tuple[float, bool, bool, int, float]]) -> int:
    """The threshold in ``[vth_max / 2, vth_max]`` with the finest weights relative to it.

    Every weight scales with ``vth``, but each connection's exponent moves in powers of two:
    just below the ``vth`` at which a connection's exponent would step up, its largest mantissa
    fills all its bits, and its rounding step relative to the threshold is the smallest one
    octave allows. ``conns``: per connection (largest weight per unit of ``vth``, mixed sign,
    bias, mantissa bits, inputs per target neuron). Minimises the rounding noise a neuron sees,
    ``sum(fan_in * (step / vth)**2)``; a tie keeps the larger ``vth``.
    """
    def cost(v: int) -> float:
        total = 0.0
        for per_vth, mixed, bias, bits, fan_in in conns:
            step = 2.0 ** _weight_exp(per_vth * v, mixed, bias, bits) * (2 if mixed else 1)
            total += fan_in * (step / v) ** 2
        return total

    cands = {vth_max}
    for per_vth, mixed, _, bits, _ in conns:
        lim = 2**bits - 2 if mixed else 2**bits - 1
        for k in range(-40, 40):  # breakpoints vth = lim * 2**k / per_vth within the octave
            v = math.floor(lim * 2.0**k / per_vth)
            if vth_max / 2 <= v <= vth_max:
                cands.add(v)
    return min(sorted(cands, reverse=True), key=cost) if conns else vth_max


def _bits(weight_bits: int | Mapping[str, int], name: str, what: str = "weight_bits",
          lo: int = 1, hi: int = 24, default: int = 8) -> int:
    b = weight_bits.get(name, weight_bits.get("*", default)) if isinstance(weight_bits, Mapping) else weight_bits
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not lo <= b <= hi:
        raise BackendError(f"{what} for {name!r} must be an integer in {lo}..{hi}, got {b!r}")
    return int(b)


#: ``weight_groups="auto"``: a connection whose 8-bit weights' relative RMS rounding error
#: exceeds this gets the second synapse group (see :func:`quantize`); benchmarks/README.md,
#: "Defaults", row "Loihi 2 second synapse group".
SECOND_GROUP_ERROR = 0.005


def _groups(weight_groups: int | str | Mapping[str, int | str], name: str, rel_error: float) -> int:
    """1 or 2 synapse groups for connection ``name`` whose single group's relative RMS rounding
    error is ``rel_error``."""
    g: Any = weight_groups.get(name, weight_groups.get("*", 1)) if isinstance(weight_groups, Mapping) else weight_groups
    if g == "auto":
        return 2 if rel_error > SECOND_GROUP_ERROR else 1
    return _bits(g, name, "weight_groups", 1, 2, 1)


def _shifted_bounds(pos: np.ndarray, neg: np.ndarray, e: int) -> tuple[np.ndarray, np.ndarray]:
    pos, neg = pos.astype(np.int64), neg.astype(np.int64)
    if e >= 0:
        return pos << e, neg << e
    return pos >> -e, neg >> -e


def _row_sums(kind: str, m: np.ndarray, tgt_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per target neuron: the largest positive and negative input sums (every source spiking)."""
    n = int(np.prod(tgt_shape))
    if kind == "conv":
        k = m.reshape(m.shape[0], -1)
        pos, neg = np.clip(k, 0, None).sum(1), np.clip(k, None, 0).sum(1)
        return per_neuron_values(pos, tgt_shape), per_neuron_values(neg, tgt_shape)
    if kind == "matrix":
        return np.clip(m, 0, None).sum(1), np.clip(m, None, 0).sum(1)
    mm = m.reshape(n).astype(np.float64)
    return np.clip(mm, 0, None), np.clip(mm, None, 0)


def _per_vth(kind: str, w: np.ndarray, theta: np.ndarray, shape: tuple[int, ...], cname: str,
             weight_bits: int | Mapping[str, int], split: bool) -> tuple[float, bool, bool, int, float]:
    """A connection's entry for :func:`_best_vth`: its weights in ``a_in`` units are
    ``w * vth / theta`` (per target channel)."""
    n = int(np.prod(shape))
    if kind == "conv":
        sc = w / per_neuron_values(theta, (w.shape[0],)).reshape(-1, *([1] * (w.ndim - 1)))
        fan_in = float(np.count_nonzero(w)) / w.shape[0]
    elif kind == "matrix":
        sc = w / per_neuron_values(theta, shape)[:, None]
        fan_in = float(np.count_nonzero(w)) / n
    else:  # diag, bias: one input per neuron
        sc = w.reshape(-1) / per_neuron_values(theta, shape)
        fan_in = 1.0
    return (float(np.abs(sc).max()), bool(sc.min() < 0 < sc.max()) and not split, kind == "bias",
            _bits(weight_bits, cname), fan_in)


def _v_init(op: Any, vth: int | np.ndarray, shape: tuple[int, ...]) -> int | np.ndarray:
    """A neuron op's initial membrane in integer ``v`` units (see :class:`Population`); one
    integer per neuron ``[size]`` where ``vth`` is per channel or ``v_init`` calibrated."""
    if op.params.get("reset") != "subtract":  # hard reset and leaky neurons start at 0
        return 0
    v0 = op.params.get("v_init")
    if np.ndim(vth) == 0 and (v0 is None or (np.ndim(v0) == 0 and float(v0) == 0.5)):
        return (int(vth) << LOIHI["vth_shift"]) // 2
    full_vth = per_neuron_values(np.asarray(vth, np.float64), shape) * 2.0 ** LOIHI["vth_shift"]
    if v0 is None or (np.ndim(v0) == 0 and float(v0) == 0.5):
        return (full_vth.astype(np.int64) // 2).astype(np.int64)
    full = per_neuron_values(np.asarray(v0, np.float64).reshape(-1), shape)
    return np.round(full * full_vth).astype(np.int64)


def _bias_report(const: np.ndarray, scale: np.ndarray) -> dict[str, Any]:
    """What the bias current keeps of a layer's biases (as :func:`.simulate.bias_current`
    rounds them): nonzero biases, those rounded to zero, relative RMS error, clipped."""
    val = const * scale
    mmax, emax = LOIHI["bias_mant_max"], LOIHI["bias_exp_max"]
    exp = np.zeros(val.shape)
    for k in range(emax):
        exp += np.round(np.abs(val) * 2.0**-k) > mmax
    mant = np.round(val * 2.0**-exp)
    clipped = int((np.abs(mant) > mmax).sum())
    deq = np.clip(mant, -mmax, mmax) * 2.0**exp
    nz = const != 0
    err = float(np.sqrt(((deq - val) ** 2).sum() / max((val**2).sum(), 1e-300)))
    return {"path": "bias current (13-bit mantissa, exponent 0..7 per neuron)", "nonzero": int(nz.sum()),
            "zero_rounded": int((nz & (deq == 0)).sum()), "rel_error": err, "clipped": clipped}


def _saturating_bias(bias: np.ndarray, pos: np.ndarray, neg: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """IF neurons' biases clipped where the clipping changes no spike: a neuron whose bias
    exceeds ``theta`` (its threshold; B thresholds for a burst neuron, whose most is B spikes
    a step) plus its most negative input sum ``neg`` fires its most at every step whatever
    its inputs (with either reset its membrane only grows past the threshold), and one whose bias
    is below minus its largest input sum ``pos`` never fires (its membrane, which starts at most at
    the threshold, never grows). Such biases, often thousands of thresholds on a channel that
    calibration left silent or saturated, would otherwise set the whole layer's scale (the bias
    current's 13-bit mantissa) and leave the other neurons' thresholds a few bits."""
    hi = (theta - neg) * (1 + 2**-10) + 1e-12
    lo = -pos * (1 + 2**-10) - 1e-12
    return np.where(bias > hi, hi, np.where(bias < lo, lo, bias))


def _channel_min(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Per-neuron values ``[size]`` -> their minimum per channel (dim 0) ``[C]``."""
    return values.reshape(shape[0], -1).min(1) if len(shape) else values.reshape(1)


def _channel_max(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return values.reshape(shape[0], -1).max(1) if len(shape) else values.reshape(1)


def _burst(op: Any) -> int:
    """The most spikes the neuron op ``op`` emits in one step (1 but for a burst neuron, whose
    count travels as one graded spike)."""
    return int(op.params.get("burst", 1)) if op.kind == "neuron" else 1


def _burst_report(op: Any) -> dict[str, Any]:
    return {"burst": _burst(op), "spikes": f"graded, 0..{_burst(op)} per step"} if _burst(op) > 1 else {}


def quantize(graph: Any, *, weight_bits: int | Mapping[str, int] = 8, split_signs: bool = True,
             weight_groups: int | str | Mapping[str, int | str] = "auto", per_neuron_vth: bool = True,
             mse_exponents: bool = False, backend: str = "loihi2-sim") -> QuantizedNetwork:
    """Map a NIR graph (or a :class:`ParsedGraph`) onto Loihi's fixed-point arithmetic.

    ``weight_bits``: mantissa bits of the synaptic weights, 8 on Loihi (the default), or a
    mapping connection name -> bits (``"*"``: the others) to measure what the 8-bit budget
    costs layer by layer. More than 8 bits cannot run on the chip (nor in Lava).
    ``split_signs``: a connection with weights of both signs becomes two single-sign synapse
    groups (excitatory and inhibitory) sharing one exponent, so its mantissas have 8 bits of
    magnitude instead of Lava's mixed sign mode's 7; the same synapses (zero mantissas are
    absent), two processes in Lava (see :func:`_quantize_weights`).
    ``weight_groups``: 1 or 2 synapse groups per connection, or ``"auto"`` (the default): 2
    where one group's relative RMS rounding error exceeds :data:`SECOND_GROUP_ERROR` (or a
    mapping connection name -> any of these, ``"*"``: the others). With 2, the rounding residual
    of the 8-bit weights becomes a second connection ``"<name>.lo"`` from the same source with an
    exponent about 8 lower, so the pair carries ~15-bit weights on 8-bit synapses: runnable on the
    chip (and in Lava), at twice the synapses and synaptic operations of that connection (see
    resources).
    ``per_neuron_vth``: a population whose single threshold would fall below
    ``_VTH_PER_CHANNEL`` gets one threshold per channel (the default; False: one per population).
    ``mse_exponents``: each connection's exponent is the one (of the one that fits its largest
    weight and the two below) with the least squared rounding error, clipping outliers.
    ``backend``: the name errors carry.

    Raises:
        BackendError: a structure Loihi cannot run this way (named), or weights/thresholds the
            bit budget cannot represent, or a graph the strict reader refuses (a node type it
            does not run, a malformed graph: the reader's NIRError is the cause).
    """
    opts = _Options(weight_bits, split_signs, weight_groups, per_neuron_vth, mse_exponents, backend)
    g = graph if isinstance(graph, ParsedGraph) else parse_graph(graph, backend)
    mp = Mapper(g, backend)
    targets = _targets(g, mp, backend)
    pops: list[Population] = []
    depth: dict[str, int] = {}
    static_ops: list[Any] = [op for op in g.ops if op.name in mp.static and op.kind != "input"]
    for op in targets:
        t = _target(op, mp, backend)
        pop = _static_population(t) if t.static and not t.spiking else _spiking_population(t, mp, depth, opts)
        depth[op.name] = pop.depth
        pops.append(pop)
    names = {c.name for p in pops for c in p.conns}
    for what, opt in (("weight_bits", weight_bits), ("weight_groups", weight_groups)):
        unknown = sorted(set(opt) - names - {"*"}) if isinstance(opt, Mapping) else []
        if unknown:
            raise BackendError(f"{backend}: {what} names no connection of this graph: {unknown}; "
                               f"connections: {sorted(names)}")
    return QuantizedNetwork(g, tuple(pops), tuple(static_ops), depth[targets[-1].name])


@dataclass(frozen=True)
class _Options:
    """The options of one :func:`quantize` call (see there)."""

    weight_bits: int | Mapping[str, int]
    split_signs: bool
    weight_groups: int | str | Mapping[str, int | str]
    per_neuron_vth: bool
    mse_exponents: bool
    backend: str


@dataclass
class _Target:
    """A population to quantise: its op (a spiking neuron, or the readout), the terms that feed
    it (from the static input, from spiking sources; ``late``: static chains that arrive beside
    spikes) and its float neuron (``leaky``: the chip mapping of a leaky op, else None)."""

    op: Any
    role: str
    shape: tuple[int, ...]
    static: list[tuple[str, list[Any]]]
    spiking: list[tuple[str, list[Any]]]
    late: tuple[tuple[Any, ...], ...]
    leaky: LeakySpec | None
    theta: np.ndarray
    reset: str
    chip: dict[str, Any]

    @property
    def n(self) -> int:
        return int(np.prod(self.shape))


class _Raw(NamedTuple):
    """One connection's float weights, unscaled: ``kind`` ``"conv"`` (``conv``: its parameters),
    ``"diag"`` or ``"matrix"``; ``delay`` in steps; ``burst``: the most spikes its source emits
    in one step."""

    name: str
    source: str
    kind: str
    weight: np.ndarray
    conv: Any
    delay: int
    burst: int
    source_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Inputs:
    """What reaches a spiking population: its connections, its pipeline depth, its constant input
    (biases; static input arriving late) and whether that enters as the bias current, its
    worst-case input per neuron (float units) and the integer budget ``a_max`` for it."""

    raw: list[_Raw]
    depth: int
    const: np.ndarray
    as_current: bool
    worst: np.ndarray
    a_max: int


class _Fitted(NamedTuple):
    """A population's integer thresholds, scale and connections within its input budget."""

    vth: Any
    raised: int
    scale: np.ndarray
    conns: list[Connection]
    bound: int


def _targets(g: ParsedGraph, mp: Mapper, backend: str) -> list[Any]:
    """The ops that become populations: the spiking neurons, then the readout (the Output's op,
    or a leaky LI directly before the Output)."""
    readout = g.ops[-1]
    if len(readout.inputs) == 1 and mp.ops[readout.inputs[0]].kind == "li":
        readout = mp.ops[readout.inputs[0]]
    for op in g.ops:
        if op.kind == "li" and op is not readout:
            leaky_spec(op, False, "neuron")  # refused, with the reason
    targets = [op for op in g.ops if op.kind in SPIKING] + [readout]
    if len(targets) == 1:
        raise BackendError(f"{backend}: the graph has no neurons; Loihi runs spiking networks")
    return targets


def _target(tgt: Any, mp: Mapper, backend: str) -> _Target:
    """What feeds ``tgt`` and its float neuron, refusing a static input Loihi cannot carry."""
    role = "neuron" if tgt.kind in SPIKING else "readout"
    shape = tuple(tgt.out_shape if role == "neuron" else tgt.in_shape or tgt.out_shape)
    terms = mp.terms(tgt.name)
    static = [t for t in terms if t[0] == "__static__"]
    spiking = [t for t in terms if t[0] != "__static__"]
    if static and role == "readout":
        raise BackendError(f"{backend}: the readout '{tgt.name}' is fed by the static input "
                           f"({static[0][1][0].name}) directly; the readout has no bias current "
                           "to carry it: put a neuron layer between them")
    late = tuple(tuple(chain) for _, chain in static) if static and spiking else ()
    leaky = leaky_spec(tgt, bool(static), role) if tgt.kind in ("lif", "cubalif", "li") else None
    if leaky is not None:  # an IF neuron with threshold v_threshold / gain (see .leaky)
        theta, reset = leaky.theta, ("zero" if role == "neuron" else "none")
    elif role == "neuron":
        theta = np.asarray(tgt.params["theta"], np.float64).reshape(-1)
        if (theta <= 0).any() or not np.isfinite(theta).all():
            raise BackendError(f"{backend}: neuron '{tgt.name}' has a non-positive threshold")
        reset = str(tgt.params["reset"])
    else:
        theta, reset = np.ones(1), "none"
    if late and leaky is not None:
        raise BackendError(f"{backend}: the leaky neuron '{tgt.name}' sums the static input "
                           f"({static[0][1][0].name}) with spikes; only IF neurons take it as "
                           "a bias current")
    chip: dict[str, Any] = {} if leaky is None else {"du": leaky.du, "dv": leaky.dv, "gain": np.asarray(leaky.gain)}
    return _Target(tgt, role, shape, static, spiking, late, leaky, theta, reset, chip)


def _static_population(t: _Target) -> Population:
    """A population fed by the static input alone, at depth 0: its bias current reaches about two
    thresholds, 2B for a burst neuron (which emits up to B a step)."""
    tgt = t.op
    vth = max(1, FIRST_VTH // _burst(tgt))
    scale = (vth << LOIHI["vth_shift"]) / t.theta
    return Population(
        tgt.name, t.role, t.shape, 0, vth, _v_init(tgt, vth, t.shape),
        t.reset, scale, (), True,
        {"vth": vth, "v_threshold": vth << 6, "bias": "per-image current (13-bit mant, exp 0..7)",
         **_burst_report(tgt), **({} if t.leaky is None else t.leaky.report)}, burst=_burst(tgt), **t.chip)


def _spiking_population(t: _Target, mp: Mapper, depth: Mapping[str, int], opts: _Options) -> Population:
    """A population fed by spikes: integer weights and thresholds within its input budget."""
    tgt = t.op
    x = _inputs(t, mp, depth)
    vth, theta, raised = _first_vth(t, x, opts) if t.role == "neuron" else (0, t.theta, 0)
    f = _fit(t, x, vth, theta, raised, opts)
    return Population(tgt.name, t.role, t.shape, x.depth, f.vth,
                      _v_init(tgt, f.vth, t.shape) if t.role == "neuron" else 0, t.reset,
                      np.asarray(f.scale, np.float64), tuple(f.conns), False, _report(t, x, f),
                      late_static=t.late, bias=x.const.astype(np.float64) if x.as_current else None,
                      burst=_burst(tgt) if t.role == "neuron" else 1, **t.chip)


def _raw_connections(t: _Target, mp: Mapper, depth: Mapping[str, int], d: int) -> list[_Raw]:
    """The float weights of each chain of linear ops from a spiking source into ``t``, named after
    its last weighted op (``#2``, ``#3``... for further chains from one source)."""
    raw: list[_Raw] = []
    for s, chain in t.spiking:
        src_shape = tuple(mp.ops[s].out_shape)
        kind, core = chain_kind(chain, src_shape, t.shape)
        cparams: Any = None
        if kind == "conv" and isinstance(core, list):
            composed = chain_as_conv(core)
            assert composed is not None  # chain_kind says "conv" only where it composes
            w, cparams = composed
        elif kind == "conv":
            w, cparams = np.asarray(core.params["weight"], np.float64), conv_params(core)
        elif kind == "diag":
            w = (np.ones(t.n) if core is None else
                 np.broadcast_to(np.asarray(core.params["scale"], np.float64),
                                 core.in_shape).reshape(-1).copy())
        else:
            w = compose(chain, src_shape, t.n)
        weighted = [op.name for op in chain if op.kind in ("conv1d", "conv2d", "affine", "linear")]
        cname = weighted[-1] if weighted else f"{s}->{t.op.name}"
        if any(r.name == cname for r in raw):  # two chains from one source: distinct names
            cname = f"{cname}#{sum(r.name.split('#')[0] == cname for r in raw) + 1}"
        raw.append(_Raw(cname, s, kind, w, cparams, d - depth[s] - 1, _burst(mp.ops[s]), src_shape))
    return raw


def _inputs(t: _Target, mp: Mapper, depth: Mapping[str, int]) -> _Inputs:
    """The connections, constant input and worst-case input sums of the spiking population ``t``."""
    d = max(depth[s] for s, _ in t.spiking) + 1
    raw = _raw_connections(t, mp, depth, d)
    const = mp.const(t.op.name).reshape(-1).numpy()  # static inputs: 0 (a bias per image)
    # IF neurons and the IF readout take their biases as the neurons' bias current (13-bit
    # mantissa per neuron); leaky ones through a connection from the clock neuron
    as_current = t.leaky is None and bool(np.any(const != 0))
    # per-neuron worst-case sums in float units
    pos = np.zeros(t.n)
    neg = np.zeros(t.n)
    for r in raw:
        p_, n_ = _row_sums(r.kind, r.weight, t.shape)
        pos, neg = pos + p_ * r.burst, neg + n_ * r.burst
    if as_current and t.role == "neuron" and not t.late:
        const = _saturating_bias(const, pos, neg, per_neuron_values(t.theta, t.shape) * _burst(t.op))
    if not as_current:
        pos, neg = pos + np.clip(const, 0, None), neg + np.clip(const, None, 0)
    a_max = LOIHI["a_in_max"] if t.leaky is None else t.leaky.a_in_max
    return _Inputs(raw, d, const, as_current, np.maximum(pos, -neg), a_max)


def _first_vth(t: _Target, x: _Inputs, opts: _Options) -> tuple[Any, np.ndarray, int]:
    """A neuron population's first integer threshold, its float theta and how many channels'
    thetas were raised: the largest ``vth`` whose worst-case input (and bias current) fits."""
    theta = t.theta
    theta_n = per_neuron_values(theta, t.shape)
    with np.errstate(divide="ignore"):
        lim = np.where(x.worst > 0, 64.0 * x.a_max * theta_n / np.maximum(x.worst, 1e-300), np.inf)
        if x.as_current:  # the bias current |b| * (vth << 6) / theta within _BIAS_MAX
            lim = np.minimum(lim, np.where(x.const != 0, _BIAS_MAX * theta_n
                                           / np.maximum(np.abs(x.const), 1e-300), np.inf))
    cap = _LATE_STATIC_VTH if t.late else _VTH_CAP
    vth = int(min(cap, math.floor(float(lim.min()) / 64.0)))
    lim_c = np.minimum(cap, np.floor(_channel_min(lim, t.shape) / 64.0))
    if opts.per_neuron_vth and t.leaky is None and lim_c.size > 1 and vth < _VTH_PER_CHANNEL:
        # one threshold per channel (a custom neuron program): each channel's integer
        # weights fill the input budget its own worst case leaves (see the module doc).
        # A channel whose worst case exceeds a_max thresholds even at vth = 1 (a channel
        # calibration left silent, theta floored at 1e-3) gets its threshold raised to
        # worst / a_max: its output scale theta is tiny, so its spikes barely matter
        worst_c = _channel_max(x.worst, t.shape)
        theta_c = np.broadcast_to(theta, lim_c.shape).astype(np.float64)
        theta = np.where(lim_c < 1, np.maximum(theta_c, worst_c / x.a_max * 1.02), theta_c)
        return np.maximum(lim_c, 1).astype(np.int64), theta, int((lim_c < 1).sum())
    if vth >= 2:
        bits, split = opts.weight_bits, opts.split_signs
        vth = _best_vth(vth, [_per_vth(r.kind, r.weight, theta, t.shape, r.name, bits, split) for r in x.raw]
                        + ([_per_vth("bias", x.const, theta, t.shape, f"{t.op.name}.bias", bits, split)]
                           if np.any(x.const != 0) and not x.as_current else []))
    return vth, theta, 0


def _fit(t: _Target, x: _Inputs, vth: Any, theta: np.ndarray, raised: int, opts: _Options) -> _Fitted:
    """Quantise the connections until their integer worst case fits ``a_max``: a neuron's
    threshold is lowered (per channel, only the channels over budget; at ``vth = 1`` theta is
    raised instead), the readout's scale shrinks by 3% a try."""
    for attempt in range(12):
        if t.role == "neuron":
            if np.min(vth) < 1:
                raise BackendError(
                    f"{opts.backend}: neuron '{t.op.name}': its worst-case input is more than "
                    f"{x.a_max} times its threshold; the 16-bit input budget cannot hold it")
            scale_c = np.asarray(vth, np.float64) * 64.0 / theta
        else:
            gain = np.ones(1) if t.leaky is None else t.leaky.gain  # membrane units: scale / gain
            wmax = float((x.worst * per_neuron_values(gain, t.shape)).max())
            scale_c = np.asarray(gain) * (64.0 * x.a_max / wmax if wmax > 0 else 1.0) * (0.97 ** attempt)
            if x.as_current:  # the biases fit the bias current
                scale_c = np.minimum(scale_c, _BIAS_MAX / float(np.abs(x.const).max()))
        conns, tot_pos, tot_neg = _integer_connections(t, x, scale_c, opts)
        bound = int(max(tot_pos.max(initial=0), -tot_neg.min(initial=0)))
        if bound <= x.a_max:
            return _Fitted(vth, raised, scale_c, conns, bound)
        if t.role == "neuron" and np.ndim(vth):  # lower only the channels over budget
            b_c = _channel_max(np.maximum(tot_pos, -tot_neg).astype(np.float64), t.shape)
            new = np.where(b_c > x.a_max, np.floor(vth * x.a_max / np.maximum(b_c, 1) * 0.99), vth)
            low = new < 1  # already at vth = 1: raise the threshold instead
            raised += int((low & (theta * (b_c / x.a_max / 0.99) > theta)).sum())
            theta = np.where(low, theta * np.maximum(b_c / x.a_max / 0.99, 1.0), theta)
            vth = np.maximum(new, 1).astype(np.int64)
        elif t.role == "neuron":
            vth = int(vth * x.a_max / bound * 0.99)
    raise BackendError(f"{opts.backend}: '{t.op.name}': no scale keeps the worst-case input "
                       f"within {x.a_max}")


def _integer_connections(t: _Target, x: _Inputs, scale_c: np.ndarray, opts: _Options
                         ) -> tuple[list[Connection], np.ndarray, np.ndarray]:
    """The connections into ``t`` at scale ``scale_c`` (integer units per float unit) and the
    largest positive and negative integer input per neuron they can deliver."""
    s_n = per_neuron_values(scale_c, t.shape)
    conns: list[Connection] = []
    tot_pos = np.zeros(t.n, np.int64)
    tot_neg = np.zeros(t.n, np.int64)
    for r in x.raw:
        w = r.weight
        if r.kind == "conv":
            sc = (w * per_neuron_values(scale_c, (w.shape[0],)).reshape(-1, *([1] * (w.ndim - 1)))
                  / 64.0)
        elif r.kind == "diag":
            sc = w * s_n / 64.0
        else:
            sc = w * s_n[:, None] / 64.0
        for gname, gmant, gexp, grep in _synapse_groups(r, sc, opts):
            conns.append(Connection(gname, r.source, t.op.name, r.kind, gmant, gexp, r.delay, r.conv, grep,
                                    fanout(r.kind, gmant, r.conv, r.source_shape, t.shape)))
            p_, n_ = _row_sums(r.kind, gmant, t.shape)
            p_, n_ = _shifted_bounds(p_, n_, gexp)
            # a burst source's graded spike carries up to B times the weight
            tot_pos, tot_neg = tot_pos + p_ * r.burst, tot_neg + n_ * r.burst
    if np.any(x.const != 0) and not x.as_current:
        m, e, rep = _quantize_weights(x.const * s_n / 64.0, bias=True,
                                      bits=_bits(opts.weight_bits, f"{t.op.name}.bias"), split=opts.split_signs)
        conns.append(Connection(f"{t.op.name}.bias", CLOCK, t.op.name, "bias", m, e, x.depth - 1,
                                None, rep, fanout("bias", m, None, (1,), t.shape)))
        p_, n_ = _shifted_bounds(np.clip(m, 0, None), np.clip(m, None, 0), e)
        tot_pos, tot_neg = tot_pos + p_, tot_neg + n_
    return conns, tot_pos, tot_neg


def _synapse_groups(r: _Raw, sc: np.ndarray, opts: _Options) -> list[tuple[str, np.ndarray, int, dict[str, Any]]]:
    """Connection ``r``'s weights ``sc`` (``a_in`` units) as one or two synapse groups (name,
    mantissas, exponent, report): the second carries the first's rounding residual."""
    bits = _bits(opts.weight_bits, r.name)
    m, e, rep = _quantize_weights(sc, bias=False, bits=bits, split=opts.split_signs, mse_exp=opts.mse_exponents)
    rep["float_weights"] = int(r.weight.size)
    rep["float_nonzero"] = int(np.count_nonzero(r.weight))
    groups = [(r.name, m, e, rep)]
    if _groups(opts.weight_groups, r.name, rep["rel_error"]) == 2:
        resid = sc - m.astype(np.float64) * 2.0**e
        if np.any(resid != 0):
            m2, e2, rep2 = _quantize_weights(resid, bias=False, bits=bits, split=opts.split_signs)
            if e2 < e and np.any(m2 != 0):
                deq = m.astype(np.float64) * 2.0**e + m2.astype(np.float64) * 2.0**e2
                rep2["rel_error"] = float(np.sqrt(((deq - sc) ** 2).sum()
                                                  / max((sc**2).sum(), 1e-300)))
                rep2["residual_of"] = r.name
                rep["zero_rounded_both"] = int(((m == 0) & (m2 == 0) & (sc != 0)).sum())
                groups.append((f"{r.name}.lo", m2, e2, rep2))
    return groups


def _report(t: _Target, x: _Inputs, f: _Fitted) -> dict[str, Any]:
    """The quantisation report of a spiking population (thresholds, budget, scale, bias)."""
    vth_min = int(np.min(f.vth))
    rep = {"vth": vth_min if np.ndim(f.vth) else f.vth,
           "v_threshold": vth_min << 6 if t.role == "neuron" else None,
           **({"vth_per_channel": {"min": vth_min, "median": float(np.median(f.vth)),
                                   "max": int(np.max(f.vth)), "thresholds_raised": f.raised}}
              if np.ndim(f.vth) else {}),
           **({"static_bias": [[op.name for op in ch] for ch in t.late]} if t.late else {}),
           "a_in_bound": f.bound, "a_in_budget": x.a_max,
           "scale_min": float(np.min(f.scale)), "scale_max": float(np.max(f.scale)),
           **_burst_report(t.op), **({} if t.leaky is None else t.leaky.report)}
    if t.role == "neuron" and vth_min < 64:
        rep["warning"] = (f"vth = {vth_min}: the worst-case input is about {x.a_max // max(vth_min, 1)} times "
                          "the threshold, so the threshold has few bits; expect a larger "
                          "deviation from the float network in this layer")
    if x.as_current:
        rep["bias"] = _bias_report(x.const, per_neuron_values(f.scale, t.shape))
    return rep
