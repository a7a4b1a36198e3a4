"""``loihi2-sim``: a vectorised, bit-exact fixed-point model of a converted SNN on Loihi 2.

The arithmetic is that of Intel's bit-accurate Lava process models (lava-nc 0.10.0,
``lava/proc/dense/models.py`` ``PyDenseModelBitAcc`` and ``lava/proc/lif/models.py``
``PyLifModelBitAcc``), batched with torch integer tensors. The ``lava`` backend runs the same
:class:`QuantizedNetwork` in Lava itself, and the tests check both agree bit for bit.

Per step, for every neuron (``a_in`` the sum of the incoming connections' outputs)::

    connection k:  a_k = (sum_j m_kj * s_j) << e_k      (>> -e_k, a floor, when e_k < 0)
                   m_kj: 8-bit weight mantissas (even values in mixed-sign mode), one
                   exponent e_k per connection, one step of synaptic delay (+ extra delays)
    u = wrap24(a_in << 6)                 (du = 4095: the current does not persist)
    v = clip24(v + u + bias)              (dv = 0: integrate; bias = mant << exp, 13-bit mant)
    s = v > vth << 6
    hard reset ("zero"):       v = 0 where s          (Lava's LIF, du=4095, dv=0)
    subtractive ("subtract"):  v = v - (vth << 6) where s, v[0] = (vth << 6) / 2, or
                               round(v_init * (vth << 6)) per neuron after membrane
                               calibration (a custom neuron program, as Loihi 2's
                               programmable neurons allow; Lava has no such built-in neuron)

Mapping of a parsed NIR graph (:func:`quantize`):

- every neuron op is a population; every op chain from a neuron's spikes to another neuron
  (or the readout) is one connection: a single convolution stays a convolution on integer
  tensors, an identity shortcut (``Scale``) a one-to-one connection, any other chain (pooling,
  flatten, linear) is composed into an integer weight matrix; biases become a connection from
  one always-on "clock" neuron, so that they start when the layer's first input arrives;
- the static first layer (direct encoding) runs off-chip in float32 (as the input encoder)
  and enters the first neurons as per-neuron bias currents (13-bit mantissa, exponent 0..7);
- each population sits at a pipeline depth (the longest chain of connections from the
  first layer); a connection spanning ``k`` depths gets ``k - 1`` steps of extra synaptic
  delay, so every neuron sees its inputs aligned exactly as in the time-stepped network. The
  chip runs ``T + depth`` steps; the readout's last ``T`` steps are the network's output;
- the readout neurons do not spike: their membrane is the per-step value of the last layer
  (``v = clip24(a_in << 6)``), read every step.

Quantisation (per population): one integer threshold ``vth`` (17 bits; per-channel
thresholds are folded into the incoming weights). Its ceiling is the largest value for which
the worst case of ``a_in`` (every input spiking) fits in 16 signed bits (Lava's ``a_in`` port
precision), so the 24-bit current can never wrap. Within the octave below that ceiling,
``vth`` is placed where the incoming weights round most finely relative to it: every weight
scales with ``vth`` while each connection's exponent moves in powers of two, so just below an
exponent step a connection's largest mantissa fills all 8 bits (:func:`_best_vth`; on the
Fashion-MNIST ResNet-14 this halves the weight rounding step of most layers and brings
``loihi2-sim`` from -0.56 to -0.13 points of the float SNN). Then each connection's exponent
follows from its largest weight. A connection whose weights have both signs is mapped as two
synapse groups, one excitatory and one inhibitory, sharing its exponent (``split_signs``, on
by default): each keeps 8 bits of magnitude, where Lava's mixed sign mode keeps 7 (even
mantissas). Zero mantissas are absent synapses, so the split costs no synapses; in Lava it is
two Dense/Sparse processes into the same neurons. On the Fashion-MNIST ResNet-14 (hard reset,
10,000 test images) it raises the share of images on which loihi2-sim and the float SNN agree
from 90.5% to 91.1% (the same network with 16-bit weights: 92.8%).

Finer weights on 8-bit synapses (``weight_groups=2``, off by default): a connection's rounding
residual becomes a second synapse group ``"<name>.lo"`` from the same source with an exponent
about 8 lower (negative exponents floor each group's sum, as Lava's Dense does), so the pair
carries ~15-bit weights at twice that connection's synapses and synaptic operations. Errors
made in early layers are amplified by every layer after them, so the first layers gain most
(a mapping ``{connection: 2}`` selects them; benchmarks/README.md has the trade-off measured).

Nothing is wrapped silently: the worst case is checked on the integer
mantissas at compile time, and saturation, wrapping and bias clipping are counted at run time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError

from .nirgraph import ParsedGraph, parse
from .registry import Backend, Program, RunResult

__all__ = ["Loihi2SimBackend", "Loihi2Program", "QuantizedNetwork", "Population", "Connection",
           "quantize", "run_quantized", "bias_current", "resources", "energy", "format_report",
           "LOIHI", "CLOCK"]

# --- the bit budget (Lava 0.10.0 fixed-point models) ----------------------------------------

#: Bit widths and shifts of Loihi's neuro core as modelled by Lava's bit-accurate models.
LOIHI: Mapping[str, int] = {
    "uv_bits": 24,          # u, v: 24-bit signed (PyLifModelBitAcc: precision=24)
    "act_shift": 6,         # a_in << 6 into u (AbstractPyLifModelFixed.act_shift)
    "vth_shift": 6,         # spike on v > vth << 6 (vth_shift)
    "vth_max": 2**17 - 1,   # vth: unsigned 17-bit
    "bias_mant_max": 4095,  # bias_mant: signed 13-bit (we use -4095..4095)
    "bias_exp_max": 7,      # bias_exp: unsigned 3-bit
    "weight_max": 255,      # 8-bit weight mantissa; mixed sign: even values -256..254
    "weight_exp_min": -8,   # Loihi weight exponent range (Lava accepts any; Loihi: -8..7)
    "weight_exp_max": 7,
    "a_in_max": 2**15 - 1,  # a_in / Dense a_out: declared 16-bit signed in Lava
}
_V_MAX = 2 ** (LOIHI["uv_bits"] - 1)    # 2**23
_VTH_CAP = 2**16                        # vth << 6 <= 2**22: headroom above the threshold
FIRST_VTH = 2**12                       # first layer: vth << 6 = 2**18, bias reach ~2 * threshold

#: Name of the always-on neuron that delivers biases.
CLOCK = "__clock__"

# --- published per-operation figures (energy, latency) --------------------------------------

#: Davies et al., "Loihi: A Neuromorphic Manycore Processor with On-Chip Learning", IEEE Micro
#: 38(1), 2018, Table 2 (Loihi 1, 14 nm). Intel has not published per-operation energies for
#: Loihi 2 (Intel 4); we use these Loihi 1 figures as an upper estimate.
E_SYNOP = 23.6e-12          # J per synaptic spike operation
E_NEURON_UPDATE = 52e-12    # J per active neuron update
E_SPIKE = 1.7e-12           # J per spike sent within a tile
#: Horowitz, "Computing's energy problem", ISSCC 2014 (45 nm): fp32 multiply 3.7 pJ + add
#: 0.9 pJ. The per-MAC figure the SNN literature uses for the ANN on GPU-class hardware (an
#: optimistic one: it leaves out memory traffic).
E_MAC_FP32 = 4.6e-12
#: Loihi 2 brief (Intel, "Taking Neuromorphic Computing to the Next Level with Loihi 2",
#: 2021): 128 neuro cores per chip, up to 1M neurons and 120M synapses per chip, i.e. 8192
#: neurons per core; the per-core synapse figure below is the chip total / 128 (approximate:
#: the real capacity depends on weight precision, sparsity, weight sharing and axon tables).
CORES_PER_CHIP = 128
NEURONS_PER_CORE = 8192
SYNAPSES_PER_CORE = 120_000_000 // 128
#: Seconds per algorithmic time step: an assumption, not a published constant. Loihi's step
#: time depends on activity and on the barrier synchronisation across cores; reported values
#: for small networks are in the microseconds to tens of microseconds (order of magnitude).
STEP_SECONDS = 10e-6


# --- data structures -----------------------------------------------------------------------

@dataclass(frozen=True)
class Connection:
    """One synaptic connection (one Lava Dense/Sparse process): source spikes -> target ``a_in``.

    Attributes:
        name: the weighted op it realises (or ``"<source>-><target>"``, ``"<target>.bias"``).
        source: the source population (or :data:`CLOCK` for biases).
        target: the target population.
        kind: ``"conv"`` (integer convolution), ``"matrix"`` (``[N_target, N_source]``),
            ``"diag"`` (one-to-one, ``[N]``) or ``"bias"`` (from the clock neuron, ``[N]``).
        mant: integer weight mantissas (int32), layout by ``kind`` (conv: the kernel).
        exp: the weight exponent.
        delay: extra synaptic delay in steps (on top of the one step every connection has).
        conv: for ``kind == "conv"``: ndim, stride, padding, dilation, groups.
        report: quantisation record (exponent, bits used, rounding error, ...).
        fanout: synapses per source neuron ``[N_source]`` (for synaptic operation counts).
    """

    name: str
    source: str
    target: str
    kind: str
    mant: np.ndarray
    exp: int
    delay: int
    conv: Mapping[str, Any] | None
    report: Mapping[str, Any]
    fanout: np.ndarray = field(default_factory=lambda: np.ones(1))

    def coo(self, src_shape: Sequence[int], tgt_shape: Sequence[int]) -> tuple[np.ndarray, ...]:
        """One image's integer weight matrix ``[N_target, N_source]`` as COO (rows, cols, vals).

        A bias connection has one column (the clock neuron). Zero mantissas are left out.
        """
        n_tgt = int(np.prod(tgt_shape))
        if self.kind == "matrix":
            rows, cols = np.nonzero(self.mant)
            return rows, cols, self.mant[rows, cols]
        if self.kind in ("diag", "bias"):
            idx = np.nonzero(self.mant.reshape(n_tgt))[0]
            return idx, (np.zeros_like(idx) if self.kind == "bias" else idx), self.mant.reshape(-1)[idx]
        return _conv_coo(self.mant, self.conv, tuple(src_shape), tuple(tgt_shape))


def _conv_coo(mant: np.ndarray, p: Mapping[str, Any], src_shape: tuple[int, ...],
              tgt_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An integer convolution as a sparse matrix: for each output neuron and kernel entry, the
    input neuron it reads (padding positions dropped)."""
    two = p["ndim"] == 2
    c_in = src_shape[0]
    src = src_shape if two else (src_shape[0], 1, src_shape[1])
    k = mant if two else mant[:, :, None, :]
    pad = tuple(p["padding"]) if two else (0, p["padding"][0])
    stride = tuple(p["stride"]) if two else (1, p["stride"][0])
    dil = tuple(p["dilation"]) if two else (1, p["dilation"][0])
    idx = torch.arange(1, int(np.prod(src)) + 1, dtype=torch.float64).reshape(1, *src)
    unf = F.unfold(idx, k.shape[2:], dilation=dil, padding=pad, stride=stride)[0]  # [C*kh*kw, L]
    unf = unf.round().to(torch.int64).numpy() - 1
    L = unf.shape[1]
    groups = int(p["groups"])
    cin_g, cout_g, K = c_in // groups, k.shape[0] // groups, int(np.prod(k.shape[2:]))
    rows, cols, vals = [], [], []
    for oc in range(k.shape[0]):
        g = oc // cout_g
        block = unf[g * cin_g * K:(g + 1) * cin_g * K]  # [cin_g*K, L]
        w = k[oc].reshape(-1, 1).astype(np.int64)
        keep = (block >= 0) & (w != 0)
        r, _ = np.nonzero(keep)
        rows.append(oc * L + np.nonzero(keep)[1])
        cols.append(block[keep])
        vals.append(np.broadcast_to(w, block.shape)[keep])
    if L * k.shape[0] != int(np.prod(tgt_shape)):
        raise BackendError(f"convolution output {k.shape[0]} x {L} does not match {tgt_shape}")
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(vals).astype(np.int32)


@dataclass(frozen=True)
class Population:
    """Neurons of one NIR neuron op (``role="neuron"``) or the readout (``role="readout"``).

    Attributes:
        shape: batch-free shape; ``size`` neurons (flattened C-order, as in Lava).
        depth: pipeline depth (0: fed by the static input through a bias current).
        vth: integer threshold (spike on ``v > vth << 6``); 0 for the readout.
        v_init: initial membrane: ``(vth << 6) // 2`` for subtractive reset (theta/2), 0 for
            hard reset; a calibrated ``v_init`` (a fraction of theta per channel) gives one
            integer per neuron ``[size]`` (int64), ``round(v_init * (vth << 6))``.
        reset: ``"zero"``, ``"subtract"`` or ``"none"`` (readout).
        scale: integer units per float unit of this population's input, per channel ``[C]``
            or ``[1]``: ``v = x * scale`` (``scale = (vth << 6) / theta`` for neurons).
        conns: incoming connections.
        static: whether the input is the static (direct-encoded) first layer.
    """

    name: str
    role: str
    shape: tuple[int, ...]
    depth: int
    vth: int
    v_init: int | np.ndarray
    reset: str
    scale: np.ndarray
    conns: tuple[Connection, ...]
    static: bool
    report: Mapping[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def neuron_scale(self) -> np.ndarray:
        """``scale`` per neuron, ``[size]`` (float64)."""
        return _per_neuron(self.scale, self.shape)


@dataclass(frozen=True)
class QuantizedNetwork:
    """A parsed NIR graph mapped onto Loihi's integer arithmetic (see the module docstring)."""

    graph: ParsedGraph
    populations: tuple[Population, ...]   # topological order; the last one is the readout
    static_ops: tuple[Any, ...]          # ops the off-chip encoder evaluates (float32)
    depth: int                           # the readout's depth

    def population(self, name: str) -> Population:
        for p in self.populations:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def readout(self) -> Population:
        return self.populations[-1]


# --- float evaluation of ops (static part, composition of chains) --------------------------

_LINEAR = ("conv1d", "conv2d", "affine", "linear", "avgpool2d", "sumpool2d", "flatten", "scale",
           "sum")


def _flatten_dims(start: int, end: int, ndim: int) -> tuple[int, int]:
    start = start + ndim if start < 0 else start
    end = end + ndim if end < 0 else end
    return start + 1, end + 1


def _conv(x: torch.Tensor, w: torch.Tensor, p: Mapping[str, Any], b: torch.Tensor | None = None):
    fn = F.conv1d if p["ndim"] == 1 else F.conv2d
    return fn(x, w, b, tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]), int(p["groups"]))


def _conv_params(op: Any) -> dict[str, Any]:
    p = op.params
    return {"ndim": 1 if op.kind == "conv1d" else 2, "stride": tuple(p["stride"]),
            "padding": tuple(p["padding"]), "dilation": tuple(p["dilation"]), "groups": int(p["groups"])}


def _apply(op: Any, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``op`` on a batch ``x`` ``[N, *op.in_shape]`` (float32 or float64)."""
    p, k, dt, dev = op.params, op.kind, x.dtype, x.device
    if k in ("conv1d", "conv2d"):
        w = torch.as_tensor(np.array(p["weight"]), dtype=dt, device=dev)
        b = torch.as_tensor(np.array(p["bias"]), dtype=dt, device=dev) if bias else None
        return _conv(x, w, _conv_params(op), b)
    if k in ("affine", "linear"):
        w = torch.as_tensor(np.array(p["weight"]), dtype=dt, device=dev)
        y = x @ w.T
        if k == "affine" and bias:
            y = y + torch.as_tensor(np.array(p["bias"]), dtype=dt, device=dev)
        return y
    if k == "avgpool2d":
        if p.get("adaptive", False):
            return F.adaptive_avg_pool2d(x, tuple(op.out_shape[-2:]))
        return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]))
    if k == "sumpool2d":
        return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]),
                            divisor_override=1)
    if k == "flatten":
        a, e = _flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
        return x.flatten(a, e)
    if k == "scale":
        return x * torch.as_tensor(np.array(p["scale"]), dtype=dt, device=dev)
    if k == "sum":
        return x
    raise BackendError(f"loihi2-sim: op '{op.name}' of kind {k!r} is not a linear op it can map")


def _per_neuron(per_channel: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    per_channel = np.asarray(per_channel, np.float64).reshape(-1)
    n = int(np.prod(shape))
    if per_channel.size == 1:
        return np.full(n, float(per_channel[0]))
    if len(shape) == 0 or shape[0] != per_channel.size:
        raise BackendError(f"per-channel values of size {per_channel.size} do not fit shape {tuple(shape)}")
    return np.repeat(per_channel, n // shape[0])


# --- mapping a parsed graph -----------------------------------------------------------------

class _Mapper:
    def __init__(self, g: ParsedGraph):
        self.g = g
        self.ops = {op.name: op for op in g.ops}
        self.static = self._static_names()

    def _static_names(self) -> set[str]:
        static = set()
        for op in self.g.ops:
            if op.kind == "input" or (op.kind in _LINEAR and op.inputs
                                      and all(i in static for i in op.inputs)):
                static.add(op.name)
        return static

    def terms(self, name: str) -> list[tuple[str, list[Any]]]:
        """The input of op ``name`` as a list of (source neuron, chain of linear ops)."""
        out = []
        for i in self.ops[name].inputs:
            op = self.ops[i]
            if op.kind == "neuron":
                out.append((i, []))
            elif op.kind == "input" or i in self.static:
                out.append(("__static__", [op]))
            elif op.kind in _LINEAR:
                out.extend((s, chain + [op]) for s, chain in self.terms(i))
            else:
                raise BackendError(f"loihi2-sim: op '{i}' ({op.kind}) cannot feed '{name}'")
        return out

    def const(self, name: str) -> torch.Tensor:
        """The input of op ``name`` when every neuron is silent (biases only), float64, batch 1."""
        total = None
        for i in self.ops[name].inputs:
            op = self.ops[i]
            if op.kind == "neuron":
                v = torch.zeros(1, *op.out_shape, dtype=torch.float64)
            else:
                v = _apply(op, self.const(i), bias=True).reshape(1, *op.out_shape)
            total = v if total is None else total + v
        return total


def _chain_kind(chain: list[Any], src_shape: tuple[int, ...], tgt_shape: tuple[int, ...]):
    """How a chain of linear ops runs: ("conv", conv op), ("diag", scale op or None) or ("matrix", None)."""
    core = [op for op in chain if op.kind != "sum"]
    if len(core) == 1 and core[0].kind in ("conv1d", "conv2d"):
        return "conv", core[0]
    if len(core) == 2 and core[1].kind == "conv2d" and _pool_then_conv(core[0], core[1]) is not None:
        return "conv", core
    scales = [op for op in core if op.kind != "flatten"]
    if int(np.prod(src_shape)) == int(np.prod(tgt_shape)) and (
            not scales or (len(scales) == 1 and scales[0].kind == "scale")):
        return "diag", scales[0] if scales else None
    return "matrix", None


def _pool_then_conv(pool: Any, conv: Any) -> tuple[np.ndarray, dict[str, Any]] | None:
    """Average pooling (kernel = stride = k, no padding) then a stride-1 convolution, as one
    convolution: kernel ``k * K`` with ``K'[.., k*a + i, k*b + j] = K[.., a, b] / k**2``, stride
    k, padding ``k * p`` (exact). ``None`` when the pair does not have this form."""
    if pool.kind != "avgpool2d" or pool.params.get("adaptive", False):
        return None
    k = tuple(int(v) for v in pool.params["kernel_size"])
    if tuple(int(v) for v in pool.params["stride"]) != k or any(int(v) for v in pool.params["padding"]):
        return None
    if any(n % kk for n, kk in zip(pool.in_shape[-2:], k)):
        return None
    cp = _conv_params(conv)
    if cp["stride"] != (1, 1) or cp["dilation"] != (1, 1):
        return None
    w = np.asarray(conv.params["weight"], np.float64)
    big = np.repeat(np.repeat(w, k[0], axis=2), k[1], axis=3) / (k[0] * k[1])
    return big, {"ndim": 2, "stride": k, "padding": (cp["padding"][0] * k[0], cp["padding"][1] * k[1]),
                 "dilation": (1, 1), "groups": cp["groups"]}


def _compose(chain: list[Any], src_shape: tuple[int, ...], n_tgt: int) -> np.ndarray:
    """The chain's linear map (biases left out) as a float64 matrix ``[N_target, N_source]``."""
    n_src = int(np.prod(src_shape))
    if n_src * n_tgt > 2**26:
        raise BackendError(
            f"loihi2-sim: the op chain {[op.name for op in chain]} composes into a "
            f"{n_tgt} x {n_src} weight matrix, too large to build; put a convolution or a "
            "neuron layer between pooling and the next layer")
    mat = np.zeros((n_tgt, n_src))
    for lo in range(0, n_src, 1024):
        hi = min(n_src, lo + 1024)
        x = torch.zeros(hi - lo, n_src, dtype=torch.float64)
        x[torch.arange(hi - lo), torch.arange(lo, hi)] = 1.0
        x = x.reshape(hi - lo, *src_shape)
        for op in chain:
            x = _apply(op, x.reshape(hi - lo, *op.in_shape), bias=False)
        mat[:, lo:hi] = x.reshape(hi - lo, n_tgt).T.numpy()
    return mat


def _quantize_weights(scaled: np.ndarray, bias: bool, bits: int = 8,
                      split: bool = False) -> tuple[np.ndarray, int, dict[str, Any]]:
    """Float weights in ``a_in`` units -> (``bits``-bit mantissas, exponent, report).

    Mixed-sign weights keep even mantissas in ``[-2**bits + 2, 2**bits - 2]`` (Lava's mixed
    sign mode drops the lowest bit), single-sign ones ``[0, 2**bits - 1]`` (or negated). With
    ``split``, mixed-sign weights become two single-sign synapse groups with one exponent
    (``sign_mode="split"``): every mantissa in ``[-2**bits + 1, 2**bits - 1]``, twice as fine;
    only where that exponent is >= 0 (a negative one floors each group's sum separately).
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
    e = _weight_exp(amax, halve, bias, bits)
    x = scaled / 2.0**e
    m = 2.0 * np.round(x / 2.0) if halve else np.round(x)
    clipped = int((np.abs(m) > lim).sum())
    m = np.clip(m, -lim, lim).astype(np.int32)
    deq = m.astype(np.float64) * 2.0**e
    err = float(np.sqrt(((deq - scaled) ** 2).sum() / max((scaled**2).sum(), 1e-300)))
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


def _groups(weight_groups: int | Mapping[str, int], name: str) -> int:
    return _bits(weight_groups, name, "weight_groups", 1, 2, 1)


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
        return _per_neuron(pos, tgt_shape), _per_neuron(neg, tgt_shape)
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
        sc = w / _per_neuron(theta, (w.shape[0],)).reshape(-1, *([1] * (w.ndim - 1)))
        fan_in = float(np.count_nonzero(w)) / w.shape[0]
    elif kind == "matrix":
        sc = w / _per_neuron(theta, shape)[:, None]
        fan_in = float(np.count_nonzero(w)) / n
    else:  # diag, bias: one input per neuron
        sc = w.reshape(-1) / _per_neuron(theta, shape)
        fan_in = 1.0
    return (float(np.abs(sc).max()), bool(sc.min() < 0 < sc.max()) and not split, kind == "bias",
            _bits(weight_bits, cname), fan_in)


def _v_init(op: Any, vth: int, shape: tuple[int, ...]) -> int | np.ndarray:
    """A neuron op's initial membrane in integer ``v`` units (see :class:`Population`)."""
    if op.params["reset"] != "subtract":
        return 0
    v0 = op.params.get("v_init")
    if v0 is None or (np.ndim(v0) == 0 and float(v0) == 0.5):
        return (vth << LOIHI["vth_shift"]) // 2
    full = _per_neuron(np.asarray(v0, np.float64).reshape(-1), shape)
    return np.round(full * (vth << LOIHI["vth_shift"])).astype(np.int64)


def quantize(graph: Any, *, weight_bits: int | Mapping[str, int] = 8, split_signs: bool = True,
             weight_groups: int | Mapping[str, int] = 1) -> QuantizedNetwork:
    """Map a NIR graph (or a :class:`ParsedGraph`) onto Loihi's fixed-point arithmetic.

    ``weight_bits``: mantissa bits of the synaptic weights, 8 on Loihi (the default), or a
    mapping connection name -> bits (``"*"``: the others) to measure what the 8-bit budget
    costs layer by layer. More than 8 bits cannot run on the chip (nor in Lava).
    ``split_signs``: a connection with weights of both signs becomes two single-sign synapse
    groups (excitatory and inhibitory) sharing one exponent, so its mantissas have 8 bits of
    magnitude instead of Lava's mixed sign mode's 7; the same synapses (zero mantissas are
    absent), two processes in Lava (see :func:`_quantize_weights`).
    ``weight_groups``: 1 (default) or 2 synapse groups per connection (or a mapping connection
    name -> groups, ``"*"``: the others). With 2, the rounding residual of the 8-bit weights
    becomes a second connection ``"<name>.lo"`` from the same source with an exponent about 8
    lower, so the pair carries ~15-bit weights on 8-bit synapses: runnable on the chip (and in
    Lava), at twice the synapses and synaptic operations of that connection (see resources).

    Raises:
        BackendError: a structure Loihi cannot run this way (named), or weights/thresholds the
            bit budget cannot represent.
        NIRError: the graph is malformed.
    """
    g = graph if isinstance(graph, ParsedGraph) else parse(graph)
    mp = _Mapper(g)
    targets = [op for op in g.ops if op.kind in ("neuron", "output")]
    if not g.neurons:
        raise BackendError("loihi2-sim: the graph has no neurons; Loihi runs spiking networks")
    pops: list[Population] = []
    depth: dict[str, int] = {}
    static_ops: list[Any] = [op for op in g.ops if op.name in mp.static and op.kind != "input"]
    for tgt in targets:
        role = "neuron" if tgt.kind == "neuron" else "readout"
        shape = tuple(tgt.out_shape if role == "neuron" else tgt.in_shape or tgt.out_shape)
        n = int(np.prod(shape))
        terms = mp.terms(tgt.name)
        static = [t for t in terms if t[0] == "__static__"]
        spiking = [t for t in terms if t[0] != "__static__"]
        if static and spiking:
            raise BackendError(
                f"loihi2-sim: '{tgt.name}' sums the static input ({static[0][1][0].name}) with "
                "spikes; only the first neuron layer may see the static input (direct encoding)")
        if static and role == "readout":
            raise BackendError(f"loihi2-sim: the readout '{tgt.name}' is fed by the static input "
                               "directly; there is nothing to run on the chip")
        if role == "neuron":
            theta = np.asarray(tgt.params["theta"], np.float64).reshape(-1)
            if (theta <= 0).any() or not np.isfinite(theta).all():
                raise BackendError(f"loihi2-sim: neuron '{tgt.name}' has a non-positive threshold")
            reset = str(tgt.params["reset"])
        else:
            theta, reset = np.ones(1), "none"
        if static:
            vth = FIRST_VTH
            scale = (vth << LOIHI["vth_shift"]) / theta
            pops.append(Population(
                tgt.name, role, shape, 0, vth, _v_init(tgt, vth, shape),
                reset, scale, (), True,
                {"vth": vth, "v_threshold": vth << 6, "bias": "per-image current (13-bit mant, exp 0..7)"}))
            depth[tgt.name] = 0
            continue
        d = max(depth[s] for s, _ in spiking) + 1
        depth[tgt.name] = d
        # float weights per connection, unscaled
        raw = []
        for s, chain in spiking:
            src_shape = tuple(mp.ops[s].out_shape)
            kind, core = _chain_kind(chain, src_shape, shape)
            if kind == "conv" and isinstance(core, list):
                w, cparams = _pool_then_conv(*core)
            elif kind == "conv":
                w, cparams = np.asarray(core.params["weight"], np.float64), _conv_params(core)
            elif kind == "diag":
                w = (np.ones(n) if core is None else
                     np.broadcast_to(np.asarray(core.params["scale"], np.float64),
                                     core.in_shape).reshape(-1).copy())
            else:
                w = _compose(chain, src_shape, n)
            weighted = [op.name for op in chain if op.kind in ("conv1d", "conv2d", "affine", "linear")]
            cname = weighted[-1] if weighted else f"{s}->{tgt.name}"
            if any(r[0] == cname for r in raw):  # two chains from one source: distinct names
                cname = f"{cname}#{sum(r[0].split('#')[0] == cname for r in raw) + 1}"
            raw.append((cname, s, kind, w, cparams if kind == "conv" else None))
        const = mp.const(tgt.name).reshape(-1).numpy()
        # per-neuron worst-case sums in float units
        pos = np.zeros(n)
        neg = np.zeros(n)
        for _, _, kind, w, _ in raw:
            p_, n_ = _row_sums(kind, w, shape)
            pos, neg = pos + p_, neg + n_
        pos, neg = pos + np.clip(const, 0, None), neg + np.clip(const, None, 0)
        worst = np.maximum(pos, -neg)
        a_max = LOIHI["a_in_max"]
        if role == "neuron":
            theta_n = _per_neuron(theta, shape)
            with np.errstate(divide="ignore"):
                lim = np.where(worst > 0, 64.0 * a_max * theta_n / np.maximum(worst, 1e-300), np.inf)
            vth = int(min(_VTH_CAP, math.floor(float(lim.min()) / 64.0)))
            if vth >= 2:
                vth = _best_vth(vth, [_per_vth(kind, w, theta, shape, cname, weight_bits, split_signs)
                                      for cname, _, kind, w, _ in raw]
                                + ([_per_vth("bias", const, theta, shape, f"{tgt.name}.bias", weight_bits, split_signs)]
                                   if np.any(const != 0) else []))
        else:
            vth = 0
        for attempt in range(12):
            if role == "neuron":
                if vth < 1:
                    raise BackendError(
                        f"loihi2-sim: neuron '{tgt.name}': its worst-case input is more than "
                        f"{a_max} times its threshold; the 16-bit input budget cannot hold it")
                scale_c = (vth << 6) / theta
            else:
                wmax = float(worst.max())
                scale_c = np.array([64.0 * a_max / wmax if wmax > 0 else 1.0]) * (0.97 ** attempt)
            s_n = _per_neuron(scale_c, shape)
            conns: list[Connection] = []
            tot_pos = np.zeros(n, np.int64)
            tot_neg = np.zeros(n, np.int64)
            for cname, s, kind, w, cparams in raw:
                if kind == "conv":
                    sc = w * _per_neuron(scale_c, (w.shape[0],)).reshape(-1, *([1] * (w.ndim - 1))) / 64.0
                elif kind == "diag":
                    sc = w * s_n / 64.0
                else:
                    sc = w * s_n[:, None] / 64.0
                bits = _bits(weight_bits, cname)
                m, e, rep = _quantize_weights(sc, bias=False, bits=bits, split=split_signs)
                rep["float_weights"] = int(w.size)
                delay = d - depth[s] - 1
                groups = [(cname, m, e, rep)]
                if _groups(weight_groups, cname) == 2:
                    # the rounding residual as a second synapse group with a smaller exponent
                    resid = sc - m.astype(np.float64) * 2.0**e
                    if np.any(resid != 0):
                        m2, e2, rep2 = _quantize_weights(resid, bias=False, bits=bits, split=split_signs)
                        if e2 < e:
                            deq = m.astype(np.float64) * 2.0**e + m2.astype(np.float64) * 2.0**e2
                            rep2["rel_error"] = float(np.sqrt(((deq - sc) ** 2).sum()
                                                              / max((sc**2).sum(), 1e-300)))
                            rep2["residual_of"] = cname
                            groups.append((f"{cname}.lo", m2, e2, rep2))
                for gname, gmant, gexp, grep in groups:
                    conns.append(Connection(gname, s, tgt.name, kind, gmant, gexp, delay, cparams, grep,
                                            _fanout(kind, gmant, cparams, tuple(mp.ops[s].out_shape), shape)))
                    p_, n_ = _row_sums(kind, gmant, shape)
                    p_, n_ = _shifted_bounds(p_, n_, gexp)
                    tot_pos, tot_neg = tot_pos + p_, tot_neg + n_
            if np.any(const != 0):
                m, e, rep = _quantize_weights(const * s_n / 64.0, bias=True,
                                              bits=_bits(weight_bits, f"{tgt.name}.bias"), split=split_signs)
                conns.append(Connection(f"{tgt.name}.bias", CLOCK, tgt.name, "bias", m, e, d - 1,
                                        None, rep, _fanout("bias", m, None, (1,), shape)))
                p_, n_ = _shifted_bounds(np.clip(m, 0, None), np.clip(m, None, 0), e)
                tot_pos, tot_neg = tot_pos + p_, tot_neg + n_
            bound = int(max(tot_pos.max(initial=0), -tot_neg.min(initial=0)))
            if bound <= a_max:
                break
            vth = int(vth * a_max / bound * 0.99) if role == "neuron" else vth
        else:
            raise BackendError(f"loihi2-sim: '{tgt.name}': no scale keeps the worst-case input "
                               f"within {a_max}")
        rep = {"vth": vth, "v_threshold": vth << 6 if role == "neuron" else None,
               "a_in_bound": bound, "a_in_budget": a_max,
               "scale_min": float(np.min(scale_c)), "scale_max": float(np.max(scale_c))}
        if role == "neuron" and vth < 64:
            rep["warning"] = (f"vth = {vth}: the worst-case input is about {a_max // max(vth, 1)} times "
                              "the threshold, so the threshold has few bits; expect a larger "
                              "deviation from the float network in this layer")
        pops.append(Population(tgt.name, role, shape, d, vth,
                               _v_init(tgt, vth, shape) if role == "neuron" else 0, reset,
                               np.asarray(scale_c, np.float64), tuple(conns), False, rep))
    names = {c.name for p in pops for c in p.conns}
    for what, opt in (("weight_bits", weight_bits), ("weight_groups", weight_groups)):
        unknown = sorted(set(opt) - names - {"*"}) if isinstance(opt, Mapping) else []
        if unknown:
            raise BackendError(f"loihi2-sim: {what} names no connection of this graph: {unknown}; "
                               f"connections: {sorted(names)}")
    return QuantizedNetwork(g, tuple(pops), tuple(static_ops), depth[targets[-1].name])


# --- execution ------------------------------------------------------------------------------

def _static_eval(q: QuantizedNetwork, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float32 values of the static ops (the off-chip encoder) on a batch ``x``."""
    g = q.graph
    vals: dict[str, torch.Tensor] = {g.ops[0].name: x}
    for op in q.static_ops:
        inp = None
        for i in op.inputs:
            inp = vals[i] if inp is None else inp + vals[i]
        vals[op.name] = _apply(op, inp.reshape(inp.shape[0], *op.in_shape), bias=True)
    return vals


def bias_current(z: torch.Tensor, pop: Population) -> tuple[torch.Tensor, torch.Tensor, int]:
    """First-layer input ``z`` ``[B, N]`` (float) -> (bias mantissa, bias exponent, clipped count).

    ``v`` units: ``round(z * scale) = mant << exp``, ``|mant| <= 4095``, ``0 <= exp <= 7`` chosen
    per neuron. Values beyond ``4095 << 7`` (about twice the threshold) are clipped: a static
    input of at least one threshold makes the neuron spike at every step in both reset modes,
    so the clipping leaves the spikes unchanged; it is counted all the same.
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


class _Stats:
    def __init__(self):
        self.saturated = 0
        self.wrapped = 0
        self.bias_clipped = 0


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
        y = _exact(_conv(s, w, c.conv), lambda: _conv(s.double(), w.double(), c.conv))
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
                 B: int, stats: _Stats, record: bool):
    """Run ``T`` steps of ``pop``: returns (spikes ``[T, B, N]`` float32 0/1, voltages int32 or
    None). ``a_in``: the current ``u = a_in << 6``, ``[T*B, N]`` integer-valued float32;
    ``bias``: ``[B, N]``."""
    n = pop.size
    dev = (a_in if a_in is not None else bias).device
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
    vth = float(pop.vth << LOIHI["vth_shift"])
    if isinstance(pop.v_init, np.ndarray):
        v = torch.as_tensor(pop.v_init, dtype=torch.float32, device=dev).expand(B, n).clone()
    else:
        v = torch.full((B, n), float(pop.v_init), dtype=torch.float32, device=dev)
    spikes = torch.empty(T, B, n, dtype=torch.float32, device=dev)
    volts = torch.empty(T, B, n, dtype=torch.int32, device=dev) if record else None
    hard = pop.reset == "zero"
    for t in range(T):
        v.add_(u[t])
        vmin, vmax = torch.aminmax(v)
        if float(vmin) < lo or float(vmax) > hi:  # 24-bit saturation (rare): clip and count
            stats.saturated += int(((v < lo) | (v > hi)).sum())
            v.clamp_(lo, hi)
        torch.gt(v, vth, out=spikes[t])
        if hard:  # v - v * s: exact on integer-valued floats (s is 0 or 1)
            v.addcmul_(v, spikes[t], value=-1.0)
        else:
            v.sub_(spikes[t], alpha=vth)
        if record:
            volts[t] = v.to(torch.int32)
    return spikes, volts


def run_quantized(q: QuantizedNetwork, x: torch.Tensor, T: int, *, record: bool = False):
    """Run ``q`` on a static batch ``x`` ``[B, *input_shape]`` for ``T`` steps of every layer.

    Returns ``(outputs [T, B, *out_shape], counts {pop: [T]}, spikes {pop: [T, B, N]} and
    voltages {pop: [T, B, N]} (both only with ``record``), stats, synops {connection: float})``.
    Times are each population's own steps: the population at depth d runs them at chip steps
    d+1 .. d+T; before, it holds its initial state (no input has arrived).
    """
    B = x.shape[0]
    vals = _static_eval(q, x.float())
    spikes: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    volts: dict[str, torch.Tensor] = {}
    stats = _Stats()
    synops: dict[str, float] = {}
    per_neuron: dict[str, torch.Tensor] = {}   # spikes per source neuron, summed over T and B
    cache: dict = {}
    left: dict[str, int] = {}
    for p in q.populations:
        for c in p.conns:
            left[c.source] = left.get(c.source, 0) + 1
    shapes = {p.name: p.shape for p in q.populations}
    for p in q.populations:
        bias = a_in = None
        if p.static:
            z = None
            for i in q.graph.op(p.name).inputs:
                z = vals[i] if z is None else z + vals[i]
            mant, exp, clipped = bias_current(z.reshape(B, -1), p)
            stats.bias_clipped += clipped
            bias = mant << exp
        for c in p.conns:
            if c.kind == "bias":
                a = _shift(torch.as_tensor(c.mant, dtype=torch.float32, device=x.device), c.exp)
                a = (a * float(2 ** LOIHI["act_shift"])).reshape(1, -1).expand(T * B, -1)
                synops[c.name] = synops.get(c.name, 0.0) + float(T * B) * float(c.fanout.sum())
            else:
                src = spikes[c.source]
                a = _apply_conn(c, src.reshape(T * B, *shapes[c.source]), shapes[c.source],
                                p.shape, cache)
                synops[c.name] = synops.get(c.name, 0.0) + _synops(c, per_neuron[c.source])
                left[c.source] -= 1
                if left[c.source] == 0 and not record:
                    del spikes[c.source]
            a_in = a if a_in is None else a_in + a
        s, v = _neuron_loop(p, a_in, bias, T, B, stats, record)
        if s is not None:
            spikes[p.name] = s
            by_step = s.reshape(T, B, -1).sum(1)           # [T, N]
            counts[p.name] = by_step.sum(1)
            per_neuron[p.name] = by_step.sum(0)
        if v is not None:
            volts[p.name] = v
    r = q.readout
    out = volts[r.name].double() / torch.as_tensor(r.neuron_scale(), dtype=torch.float64,
                                                   device=x.device)
    out = out.float().reshape(T, B, *q.graph.output_shape)
    if not record:
        spikes, volts = {}, {}
    return out, counts, spikes, volts, stats, synops


def _fanout(kind: str, mant: np.ndarray, conv: Mapping[str, Any] | None, src_shape, tgt_shape) -> np.ndarray:
    """Synapses per source neuron ``[N_source]`` (float64); zero mantissas count as absent."""
    if kind == "conv":
        ones = torch.ones(1, *tgt_shape, dtype=torch.float64)
        w = torch.as_tensor((mant != 0).astype(np.float64))
        fn = torch.nn.grad.conv1d_input if conv["ndim"] == 1 else torch.nn.grad.conv2d_input
        f = fn((1, *src_shape), w, ones, tuple(conv["stride"]), tuple(conv["padding"]),
               tuple(conv["dilation"]), int(conv["groups"]))
        return f.reshape(-1).numpy()
    if kind == "matrix":
        return (mant != 0).sum(0).astype(np.float64)
    if kind == "bias":
        return np.array([float((mant != 0).sum())])
    return (mant.reshape(-1) != 0).astype(np.float64)


def _synops(c: Connection, per_neuron: torch.Tensor) -> float:
    """Synaptic operations of ``c`` given its source's spike count per neuron ``[N_source]``."""
    f = torch.as_tensor(c.fanout, dtype=torch.float64, device=per_neuron.device)
    return float((per_neuron.reshape(-1).double() * f).sum())


# --- reports --------------------------------------------------------------------------------

def _synapses(c: Connection) -> int:
    return int(round(float(np.sum(c.fanout))))


def resources(q: QuantizedNetwork) -> dict[str, Any]:
    """Neurons, synapses, fan-in/fan-out and cores per population under Loihi 2's per-core limits.

    Cores per population: ``max(ceil(neurons / 8192), ceil(incoming synapses / SYNAPSES_PER_CORE))``
    (see the constants' sources; synapses counted unshared, an upper bound for convolutions).
    """
    shapes = {p.name: p.shape for p in q.populations}
    shapes[CLOCK] = (1,)
    fan_out: dict[str, int] = {}
    layers = {}
    total_cores = 1  # the clock neuron shares a core in practice; counted once
    for p in q.populations:
        syn = 0
        for c in p.conns:
            k = _synapses(c)
            syn += k
            fan_out[c.source] = fan_out.get(c.source, 0) + k
        cores = max(math.ceil(p.size / NEURONS_PER_CORE), math.ceil(syn / SYNAPSES_PER_CORE), 1)
        total_cores += cores
        layers[p.name] = {"neurons": p.size, "synapses_in": syn,
                          "fan_in_mean": syn / max(p.size, 1), "depth": p.depth, "cores": cores}
    for name, k in fan_out.items():
        if name in layers:
            layers[name]["fan_out_mean"] = k / max(layers[name]["neurons"], 1)
    neurons = sum(p.size for p in q.populations) + 1
    synapses = sum(v["synapses_in"] for v in layers.values())
    return {"layers": layers, "neurons": neurons, "synapses": synapses, "cores": total_cores,
            "chips": math.ceil(total_cores / CORES_PER_CHIP),
            "limits": {"cores_per_chip": CORES_PER_CHIP, "neurons_per_core": NEURONS_PER_CORE,
                       "synapses_per_core": SYNAPSES_PER_CORE},
            "source": "Loihi 2 brief (Intel 2021): 128 cores/chip, 1M neurons and 120M synapses per "
                      "chip; per-core synapses = chip total / 128 (approximate)"}


def energy(q: QuantizedNetwork, T: int, B: int, synops: Mapping[str, float],
           spike_total: float, macs: Mapping[str, float]) -> dict[str, Any]:
    """Energy per image from synaptic ops, neuron updates and spikes, against the ANN's MACs."""
    steps = T + q.depth
    neurons = sum(p.size for p in q.populations) + 1
    syn = float(sum(synops.values())) / B
    updates = float(neurons * steps)
    spikes = float(spike_total) / B
    e_snn = syn * E_SYNOP + updates * E_NEURON_UPDATE + spikes * E_SPIKE
    ann = float(sum(macs.values())) / B
    e_ann = ann * E_MAC_FP32
    return {"per_image_J": e_snn, "synops_per_image": syn, "neuron_updates_per_image": updates,
            "spikes_per_image": spikes, "ann_macs_per_image": ann, "ann_per_image_J": e_ann,
            "ann_over_snn": e_ann / e_snn if e_snn > 0 else float("inf"),
            "figures_pJ": {"synop": E_SYNOP * 1e12, "neuron_update": E_NEURON_UPDATE * 1e12,
                           "spike": E_SPIKE * 1e12, "ann_mac": E_MAC_FP32 * 1e12},
            "sources": "SNN: Davies et al. 2018, IEEE Micro 38(1), Table 2 (Loihi 1; no per-op "
                       "figures are published for Loihi 2). ANN: Horowitz, ISSCC 2014, fp32 MAC "
                       "(45 nm), as used across the SNN literature.",
            "note": "every neuron is updated at every one of the T + depth steps"}


def _macs(g: ParsedGraph, B: int) -> dict[str, float]:
    out = {}
    for op in g.ops:
        if op.kind in ("conv1d", "conv2d"):
            w = np.asarray(op.params["weight"])
            out[op.name] = float(np.prod(op.out_shape) * np.prod(w.shape[1:]) * B)
        elif op.kind in ("affine", "linear"):
            out[op.name] = float(np.asarray(op.params["weight"]).size * B)
    return out


def quantisation_report(q: QuantizedNetwork) -> dict[str, Any]:
    """Per population: threshold, scale, depth, and per connection exponent, bits and error."""
    rep = {}
    for p in q.populations:
        rep[p.name] = dict(p.report, depth=p.depth, reset=p.reset, role=p.role,
                           connections={c.name: dict(c.report, source=c.source, delay=c.delay,
                                                     kind=c.kind) for c in p.conns})
    return rep


def _merge_runs(results: Sequence[RunResult]) -> dict[str, Any]:
    """One ``extra`` for several runs of one program: runtime counters summed, per-image energy
    figures averaged over the images."""
    ex = dict(results[-1].extra)
    if len(results) == 1:
        return ex
    if "quantisation" in ex:
        rt = {k: sum(int(r.extra["quantisation"]["runtime"].get(k, 0)) for r in results)
              for k in ("saturated", "wrapped", "bias_clipped")}
        ex["quantisation"] = dict(ex["quantisation"], runtime=rt)
    if "energy" in ex:
        n = [int(r.outputs.shape[1]) for r in results]
        e = dict(ex["energy"])
        for k in ("per_image_J", "synops_per_image", "neuron_updates_per_image", "spikes_per_image",
                  "ann_macs_per_image", "ann_per_image_J"):
            e[k] = sum(r.extra["energy"][k] * b for r, b in zip(results, n)) / sum(n)
        e["ann_over_snn"] = e["ann_per_image_J"] / e["per_image_J"] if e["per_image_J"] else float("inf")
        ex["energy"] = e
    return ex


def format_report(result: RunResult | Sequence[RunResult]) -> str:
    """Human-readable text of a loihi2-sim / lava run's ``extra``: quantisation, resources,
    latency and energy (several runs of one program: counters summed, energy averaged)."""
    ex = _merge_runs([result] if isinstance(result, RunResult) else list(result))
    lines = []
    q = ex.get("quantisation", {})
    if q:
        lines.append("quantisation (per population: vth, worst-case a_in within the 16-bit budget; "
                     "per connection: weight exponent, largest |mantissa| (8-bit; mixed sign: even "
                     "values), relative RMS rounding error, weights rounded to zero, extra delay):")
        for name, r in q.get("layers", {}).items():
            lines.append(f"  {name:<24} depth {r['depth']:>2}  vth {r.get('vth', 0):>6}  "
                         f"a_in<= {r.get('a_in_bound', '-')}"
                         + (f"  WARNING: {r['warning']}" if "warning" in r else ""))
            for cn, c in r["connections"].items():
                lines.append(f"      <- {cn:<20} {c['kind']:<6} exp {c['exp']:>3}  |m|<={c['mant_max']:>3} "
                             f"{c['sign_mode'][:5]:<5}  "
                             f"err {100 * c['rel_error']:.2f}%  zeroed {c['zero_rounded']}  "
                             f"delay +{c['delay']}")
        rt = q.get("runtime", {})
        lines.append(f"  runtime: saturated {rt.get('saturated', 0)}, wrapped {rt.get('wrapped', 0)}, "
                     f"first-layer bias clipped {rt.get('bias_clipped', 0)} (spike-preserving)")
    r = ex.get("resources")
    if r:
        lines.append(f"resources: {r['neurons']} neurons, {r['synapses']} synapses, "
                     f"{r['cores']} cores, {r['chips']} chip(s)  [{r['source']}]")
        for name, l in r["layers"].items():
            lines.append(f"  {name:<24} neurons {l['neurons']:>7}  synapses {l['synapses_in']:>9}  "
                         f"fan-in {l['fan_in_mean']:.1f}  fan-out {l.get('fan_out_mean', 0):.1f}  "
                         f"cores {l['cores']}")
    lat = ex.get("latency")
    if lat:
        lines.append(f"latency: {lat['steps']} steps (T {lat['T']} + pipeline depth {lat['depth']}), "
                     f"about {lat['seconds'] * 1e3:.3f} ms at {lat['step_seconds'] * 1e6:.0f} us/step "
                     f"({lat['note']})")
    e = ex.get("energy")
    if e:
        lines.append(f"energy per image: SNN {e['per_image_J'] * 1e6:.3f} uJ "
                     f"({e['synops_per_image']:.3g} synops, {e['spikes_per_image']:.3g} spikes, "
                     f"{e['neuron_updates_per_image']:.3g} neuron updates) vs ANN "
                     f"{e['ann_per_image_J'] * 1e6:.3f} uJ ({e['ann_macs_per_image']:.3g} MACs): "
                     f"ratio {e['ann_over_snn']:.2f}x")
        lines.append(f"  ({e['sources']})")
    return "\n".join(lines)


# --- the backend ----------------------------------------------------------------------------

_OPTIONS = {"device": "cpu", "record": False, "step_seconds": STEP_SECONDS, "batch_size": None,
            "weight_bits": 8, "split_signs": True, "weight_groups": 1}


def _check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise BackendError(f"{name}: unknown option(s) {unknown}; known: {sorted(_OPTIONS)}")
    out = dict(_OPTIONS)
    out.update(options)
    return out


def check_input(q: QuantizedNetwork, x: Any, T: Any, name: str) -> tuple[torch.Tensor, int]:
    """Validate ``x`` (a static batch ``[B, *input_shape]``) and ``T``."""
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise BackendError(f"{name}: T must be an integer >= 1, got {T!r}")
    if not isinstance(x, torch.Tensor):
        raise BackendError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    shape = tuple(q.graph.input_shape)
    if tuple(x.shape[1:]) != shape:
        if x.dim() == len(shape) + 2 and tuple(x.shape[2:]) == shape:
            raise BackendError(
                f"{name}: a per-step input [T, B, ...] cannot be run: the static first layer is "
                "mapped to bias currents (direct encoding); give a static batch [B, ...]")
        raise BackendError(f"{name}: x has shape {tuple(x.shape)}; expected [B, {', '.join(map(str, shape))}]")
    if not x.is_floating_point():
        raise BackendError(f"{name}: x must be floating point, got {x.dtype}")
    return x, int(T)


def build_result(q: QuantizedNetwork, out: torch.Tensor, counts: Mapping[str, torch.Tensor],
                 stats: Any, synops: Mapping[str, float], T: int, B: int, step_seconds: float,
                 extra: Mapping[str, Any] | None = None) -> RunResult:
    """Assemble a RunResult with the quantisation, resource, latency and energy reports."""
    counts = {k: v.reshape(T).float().cpu() for k, v in counts.items()}
    macs = _macs(q.graph, B)
    total = float(sum(float(c.sum()) for c in counts.values()))
    steps = T + q.depth
    ex = {"quantisation": {"layers": quantisation_report(q),
                           "runtime": {"saturated": int(stats.saturated), "wrapped": int(stats.wrapped),
                                       "bias_clipped": int(stats.bias_clipped)}},
          "resources": resources(q),
          "latency": {"T": T, "depth": q.depth, "steps": steps, "step_seconds": step_seconds,
                      "seconds": steps * step_seconds,
                      "note": "per-step time is an assumed order of magnitude, not a measurement"},
          "energy": energy(q, T, B, synops, total, macs)}
    ex["static_ops"] = [op.name for op in q.static_ops]
    if extra:
        ex.update(extra)
    return RunResult(outputs=out.cpu(), spikes=counts, synops=dict(synops), macs=macs, extra=ex)


class Loihi2Program(Program):
    """A graph quantised for Loihi 2; ``run(x, T)`` simulates it bit-exactly (batched)."""

    def __init__(self, q: QuantizedNetwork, options: Mapping[str, Any]):
        self.q = q
        self.options = dict(options)
        self.device = torch.device(self.options["device"])

    def run(self, x: torch.Tensor, T: int) -> RunResult:
        x, T = check_input(self.q, x, T, "loihi2-sim")
        t0 = time.perf_counter()
        x = x.to(self.device)
        bs = self.options["batch_size"]
        if bs is None:  # cache-sized chunks on a CPU (256 time-folded samples), 256 images on a GPU
            bs = 256 if self.device.type != "cpu" else max(1, 256 // T)
        bs = max(1, int(bs))
        record = bool(self.options["record"])
        outs, cnt, spk, vlt = [], {}, {}, {}
        stats = _Stats()
        synops: dict[str, float] = {}
        with torch.no_grad():
            for part in x.split(bs):
                o, c, s, v, st, sy = run_quantized(self.q, part, T, record=record)
                outs.append(o)
                for k, val in c.items():
                    cnt[k] = cnt[k] + val if k in cnt else val
                for k, val in s.items():
                    spk.setdefault(k, []).append(val.bool().cpu())
                for k, val in v.items():
                    vlt.setdefault(k, []).append(val.cpu())
                for a in ("saturated", "wrapped", "bias_clipped"):
                    setattr(stats, a, getattr(stats, a) + getattr(st, a))
                for k, val in sy.items():
                    synops[k] = synops.get(k, 0.0) + val
        extra: dict[str, Any] = {"seconds": time.perf_counter() - t0}
        if record:
            extra["trace"] = {"v": {k: torch.cat(v, dim=1) for k, v in vlt.items()},
                              "s": {k: torch.cat(v, dim=1) for k, v in spk.items()}}
        return build_result(self.q, torch.cat(outs, dim=1), cnt, stats, synops, T, x.shape[0],
                            float(self.options["step_seconds"]), extra)


class Loihi2SimBackend(Backend):
    """Bit-exact fixed-point Loihi 2 model (Lava's arithmetic), vectorised with torch.

    Options: ``device`` ("cpu" or a CUDA device), ``record`` (membrane traces in
    ``extra["trace"]``), ``step_seconds`` (latency estimate), ``batch_size`` (images per
    chunk; default ``256 // T`` on a CPU, where cache-sized chunks run fastest, else 256),
    ``weight_bits`` (8, Loihi's synapses; more, or a mapping connection -> bits, only to
    measure what the 8-bit budget costs: such a network cannot run on the chip),
    ``split_signs`` (default True: mixed-sign connections as excitatory + inhibitory synapse
    groups, 8 bits of magnitude each; False: Lava's mixed sign mode, 7), ``weight_groups``
    (1, or 2: each connection's rounding residual as a second synapse group, ~15-bit weights
    at twice the synapses; or a mapping connection -> groups; see :func:`quantize`).
    """

    name = "loihi2-sim"

    def compile(self, graph: Any, **options: Any) -> Loihi2Program:
        opts = _check_options(self.name, options)
        return Loihi2Program(quantize(graph, weight_bits=opts["weight_bits"],
                                      split_signs=bool(opts["split_signs"]),
                                      weight_groups=opts["weight_groups"]), opts)
