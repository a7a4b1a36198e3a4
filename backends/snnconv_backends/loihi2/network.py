"""The quantised network: populations of integer neurons and their synaptic connections (the
representation :func:`~snnconv_backends.loihi2.quantize` builds and every executor runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError
from snnconv.nir.reader import ParsedGraph

__all__ = ["Connection", "Population", "QuantizedNetwork", "per_neuron_values"]


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
        assert self.conv is not None, f"{self.name}: a convolution connection without its parameters"
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
    index = unf.round().to(torch.int64).numpy() - 1
    L = unf.shape[1]
    groups = int(p["groups"])
    cin_g, cout_g, K = c_in // groups, k.shape[0] // groups, int(np.prod(k.shape[2:]))
    rows, cols, vals = [], [], []
    for oc in range(k.shape[0]):
        g = oc // cout_g
        block = index[g * cin_g * K:(g + 1) * cin_g * K]  # [cin_g*K, L]
        w = k[oc].reshape(-1, 1).astype(np.int64)
        keep = (block >= 0) & (w != 0)
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
        vth: integer threshold (spike on ``v > vth << 6``); 0 for the readout; or one per
            channel ``[C]`` (int64; a custom neuron program reads it per neuron).
        v_init: initial membrane: ``(vth << 6) // 2`` for subtractive reset (theta/2), 0 for
            hard reset; a calibrated ``v_init`` (a fraction of theta per channel) gives one
            integer per neuron ``[size]`` (int64), ``round(v_init * (vth << 6))``.
        reset: ``"zero"``, ``"subtract"`` or ``"none"`` (readout).
        burst: the most spikes a subtractive neuron emits in one step, as one graded spike
            whose payload is the count (Loihi 2's graded spikes): ``s = clip((v - 1) // (vth << 6),
            0, burst)``, then ``v -= s * (vth << 6)``; 1: a binary spike on ``v > vth << 6``.
        scale: integer units per float unit of this population's input, per channel ``[C]``
            or ``[1]``: ``v = x * scale`` (``scale = (vth << 6) / theta`` for neurons).
        conns: incoming connections.
        static: whether the input is the static (direct-encoded) first layer.
        du, dv: Lava's current and voltage decays (4095 and 0: the IF neuron; leaky neurons,
            see :mod:`snnconv_backends.loihi2.leaky`).
        gain: the input gain folded into ``scale`` per channel (``dt/tau * r ...`` for a leaky
            neuron, else 1): the membrane is ``v = v_float * scale / gain``.
        late_static: op chains from the static input (or the analog prefix's output) that reach
            this population beside spikes: their value, computed off-chip once per image, enters
            as a per-neuron bias current from the population's own first step (depth > 0).
        bias: the layer biases (float units, one per neuron ``[size]``) that enter as the
            neurons' bias current (13-bit mantissa, exponent 0..7 per neuron) from the
            population's own first step, with any late static input; None: no bias, or a
            leaky population's biases, which come through a connection from :data:`CLOCK`.
    """

    name: str
    role: str
    shape: tuple[int, ...]
    depth: int
    vth: int | np.ndarray
    v_init: int | np.ndarray
    reset: str
    scale: np.ndarray
    conns: tuple[Connection, ...]
    static: bool
    report: Mapping[str, Any] = field(default_factory=dict)
    du: int = 4095
    dv: int = 0
    gain: np.ndarray = field(default_factory=lambda: np.ones(1))
    late_static: tuple = ()
    bias: np.ndarray | None = None
    burst: int = 1

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def leaky(self) -> bool:
        """Whether the current or the membrane decays (a leaky neuron or readout)."""
        return self.du != 4095 or self.dv != 0

    @property
    def has_bias(self) -> bool:
        """Whether a bias current enters (the static first layer, a late static input, or the
        layer biases)."""
        return self.static or bool(self.late_static) or self.bias is not None

    def neuron_vth(self) -> np.ndarray:
        """The integer threshold per neuron ``[size]`` (int64)."""
        return per_neuron_values(np.asarray(self.vth, np.float64), self.shape).astype(np.int64)

    def neuron_scale(self) -> np.ndarray:
        """``scale`` per neuron, ``[size]`` (float64)."""
        return per_neuron_values(self.scale, self.shape)

    def membrane_scale(self) -> np.ndarray:
        """Integer membrane units per float membrane unit, per neuron ``[size]`` (float64)."""
        return self.neuron_scale() / per_neuron_values(self.gain, self.shape)


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


def per_neuron_values(per_channel: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Per-channel values ``[C]`` (or one value ``[1]``) repeated over ``shape`` (channels
    first): one per neuron, ``[prod(shape)]`` float64."""
    per_channel = np.asarray(per_channel, np.float64).reshape(-1)
    n = int(np.prod(shape))
    if per_channel.size == 1:
        return np.full(n, float(per_channel[0]))
    if len(shape) == 0 or shape[0] != per_channel.size:
        raise BackendError(f"per-channel values of size {per_channel.size} do not fit shape {tuple(shape)}")
    return np.repeat(per_channel, n // shape[0])
