"""The strict NIR reader every snnconv executor shares: ``parse(graph) -> ParsedGraph``.

``parse`` turns a ``nir.NIRGraph`` (nir 1.0.8) into a flat tuple of :class:`Op` in topological
order, with batch-free shapes checked on every edge and the neurons rebuilt with their exact
discrete-time meaning. It never guesses: whatever it cannot read exactly is refused with
:class:`snnconv.errors.NIRError` naming the node or edge.

Neurons (both with ``theta`` per layer, shape ``()``, or per channel, shape ``(C,)``; ``theta``
is always the threshold compared with ``>=``)::

    reset "subtract" (three standard nodes: X = I(r * dt = 1), X_fire = Threshold(t),
    X_reset = Scale(-theta), edges X -> X_fire -> X_reset -> X, t = nextafter(theta/2, 0)
    compared with ">", as X's metadata states):
        h[t] = v[t-1] + x[t] / theta;  s[t] = h[t] >= 1;  v[t] = h[t] - s[t];  v[0] = 1/2
    burst B > 1 (metadata "burst": B; B Thresholds X_fire, X_fire2, ... at t_k = theta * (k - 1/2)
    into one sum Scale X_spikes, which feeds X_reset): s[t] = min(B, floor(h[t])) where h >= 1
    reset "zero" (one node X = IF(r * dt = 1, v_threshold, v_reset=0)): NIR's IF, firing on
    v > v_threshold (theta = nextafter(v_threshold, inf)), or >= where the reader is asked to
    (``compare=">="``) and the node states no comparison (theta = v_threshold):
        h[t] = v[t-1] + x[t];  s[t] = h[t] >= theta;  v[t] = h[t] * (1 - s[t]);  v[0] = 0

An IF of a file older than v_reset (graph metadata ``nir_file_version`` below 1.0.6, recorded
by ``load_nir``) resets by subtraction in absolute units and is refused with that reason.

The subtractive pattern is collapsed into one ``"neuron"`` op named ``X``; consumers of
``X_fire`` read ``X``'s spikes, and the reset edge is not an input. Any other edge from a
hidden node into an ``I`` node (another neuron's ``Threshold`` or reset ``Scale``, or
``X_fire -> X`` itself) is refused naming the edge: spikes reach an integrator through a
synapse. A node with several incoming edges receives their sum, in edge order
(``((a + b) + c)``). An ``Identity`` node, or a ``Scale``
of ones marked ``metadata["snnconv_op"] == "sum"`` (nir 1.0.8 cannot write ``Identity`` to a
file), becomes a ``"sum"`` op; a diagonal 1x1 ``Conv2d`` or ``Linear`` marked ``"scale"`` a
``"scale"`` op.

Op kinds and their ``params`` (numpy float32 arrays; python ints and tuples):

==============  ======================================================================
kind            params
==============  ======================================================================
input, output   (none)
conv1d, conv2d  weight, bias, stride, padding, dilation, groups (tuples per spatial dim)
affine          weight ``(out, in)``, bias ``(out,)``
linear          weight ``(out, in)``
avgpool2d       kernel_size, stride, padding, adaptive (bool: ``AdaptiveAvgPool2d`` in torch,
                which rounds differently from ``AvgPool2d``; kernel = stride = in / out)
sumpool2d       kernel_size, stride, padding
flatten         start_dim, end_dim (batch-free, as written in the node)
scale           scale (the node's full batch-free shape)
sum             (none)
neuron          theta (shape ``()`` or ``(C,)``), reset ("subtract" | "zero"), v_init, burst
                (only where above 1)
lif, cubalif,   Euler coefficients at ``dt`` (:mod:`snnconv.nir.leaky`)
li
==============  ======================================================================
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import nir
import numpy as np

from snnconv.errors import NIRError
from snnconv.nir.format import (
    BURST_KEY,
    COMPARE,
    COMPARES,
    FORMAT_VERSION,
    NEURON_KEY,
    OP_KEY,
    RESETS,
    SOURCE_VERSION_KEY,
    SPEC_COMPARE,
    SUM_OP,
    engine_threshold,
    fire_threshold,
    integration_gain,
    legacy_if_reason,
    predates_v_reset,
    spec_threshold,
)
from snnconv.nir.leaky import LEAKY_KINDS, read_leaky
from snnconv.nir.node_readers import read_op
from snnconv.nir.ops import OPS
from snnconv.nir.values import array as _array
from snnconv.nir.values import meta as _meta
from snnconv.vocabulary import MAX_BURST

__all__ = ["Op", "ParsedGraph", "parse", "KINDS", "RESETS", "FORMAT_VERSION"]

#: Every op kind of a parsed graph (:data:`snnconv.nir.ops.OPS`).
KINDS = tuple(OPS)

_SUPPORTED = ("Input, Output, Conv1d, Conv2d, Affine, Linear, AvgPool2d, SumPool2d, Flatten, "
              "Scale, Identity, IF (r * dt = 1, v_reset = 0) and the I/Threshold/Scale(-theta) neuron; "
              "LIF, CubaLIF, LI")


@dataclass(frozen=True)
class Op:
    """One operation of a parsed graph.

    Attributes:
        name: the node name in the NIR graph (for a neuron: the ``I`` or ``IF`` node's name).
        kind: one of :data:`KINDS`.
        inputs: names of the ops whose outputs are summed, in edge order, into this op's input.
        params: see the module docstring (read-only).
        in_shape: batch-free input shape (``None`` for the input op).
        out_shape: batch-free output shape.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    params: Mapping[str, Any]
    in_shape: tuple[int, ...] | None
    out_shape: tuple[int, ...]


@dataclass(frozen=True)
class ParsedGraph:
    """A NIR graph as ops in topological order (``ops[0]`` the input, ``ops[-1]`` the output).

    Attributes:
        reset: ``"subtract"`` or ``"zero"``, shared by every neuron.
        T: the number of steps the network was exported at (graph metadata), or ``None``.
        metadata: the graph's metadata with plain python values (read-only).
    """

    ops: tuple[Op, ...]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    reset: str
    T: int | None
    metadata: Mapping[str, Any]

    def op(self, name: str) -> Op:
        """The op called ``name`` (``KeyError`` listing the names when there is none)."""
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op {name!r}; ops: {[o.name for o in self.ops]}")

    @property
    def neurons(self) -> tuple[Op, ...]:
        """The neuron ops, in topological order."""
        return tuple(op for op in self.ops if op.kind == "neuron")


def _theta_compact(full: np.ndarray, where: str, per_channel: bool | None) -> np.ndarray:
    """A neuron threshold of the neuron's full shape as shape ``()`` or ``(C,)``."""
    if full.size == 0:
        raise NIRError(f"node '{where}': empty threshold")
    if (full <= 0).any():
        raise NIRError(f"node '{where}': thresholds must be positive; found min {float(full.min())!r}. "
                       "A non-positive threshold makes the neuron fire on every step; fix the graph.")
    flat = full.reshape(-1)
    if per_channel is not True and (flat == flat[0]).all():
        return np.array(flat[0], dtype=np.float32)
    if full.ndim == 0:
        return full.astype(np.float32)
    per = full.reshape(full.shape[0], -1)
    if not (per == per[:, :1]).all():
        raise NIRError(f"node '{where}': the threshold varies within a channel; snnconv runs "
                       "thresholds per layer or per channel (dim 0 of the batch-free shape) only")
    return np.ascontiguousarray(per[:, 0], dtype=np.float32)


def _check_neuron_meta(where: str, meta: Mapping[str, Any], reset: str, v_init: float,
                       required: bool) -> None:
    """Refuse neuron metadata that states another reset, ``v_init`` or comparison than snnconv's
    (or, where ``required``, states none)."""
    expected = {"reset": reset, "v_init": v_init, "compare": COMPARE}
    for key, want in expected.items():
        if key not in meta:
            if required:
                raise NIRError(
                    f"node '{where}': neuron metadata lacks {key!r} (expected {want!r}). The "
                    "I/Threshold/Scale pattern is read as snnconv's subtractive IF only when the "
                    "integrator's metadata says so (NIR's Threshold alone has no reset)")
            continue
        got = meta[key]
        same = (abs(float(got) - want) == 0.0) if isinstance(want, float) and isinstance(got, (int, float)) \
            else got == want
        if not same:
            raise NIRError(f"node '{where}': neuron metadata {key}={got!r}, but snnconv reads this "
                           f"node only with {key}={want!r}")


def _check_gain(name: str, r: np.ndarray, dt: float, what: str) -> None:
    """Refuse an integrator whose per-step gain ``r * dt`` is not 1 (snnconv integrates once)."""
    gain = integration_gain(r, dt)
    if (gain != 1).any():
        bad = float(np.asarray(r, np.float64).reshape(-1)[int(np.argmax((gain != 1).reshape(-1)))])
        raise NIRError(f"node '{name}': {what} with r = {bad!r} at dt = {dt!r} integrates "
                       f"r * dt = {bad * dt!r} per step; snnconv's neurons integrate their input "
                       f"once per step (r * dt = 1). Read the graph with dt = 1 / r "
                       f"(dt={1.0 / bad if bad else float('inf')!r})")


# --- the parser --------------------------------------------------------------------------------

def _read_subtractive(name: str, node: Any, meta: Mapping[str, Any], per_channel: bool | None,
                      dt: float, nodes: Mapping[str, Any], kinds: Mapping[str, str],
                      ins: Mapping[str, list[str]], outs: Mapping[str, list[str]]
                      ) -> tuple[dict[str, Any], str, str]:
    """The subtractive neuron whose integrator is ``name``: its params, the node that carries its
    spikes (its Threshold, or a burst's sum node) and its reset Scale. A burst of B (metadata
    ``burst``): B Thresholds, at :func:`fire_threshold` ``(theta, v_init, k)`` for k = 1..B, into
    one sum node that feeds the reset (see :mod:`snnconv.nir.format`)."""
    r = _array(node.r, name, "r")
    _check_gain(name, r, dt, "an integrator")
    burst = meta.get(BURST_KEY, 1)
    if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_BURST:
        raise NIRError(f"node '{name}': metadata burst={burst!r}; expected an integer in [1, {MAX_BURST}]")
    pattern = ("I -> Threshold -> Scale(-theta) -> I" if burst == 1 else
               f"I -> {burst} Thresholds -> Scale of ones (sum) -> Scale(-theta) -> I")
    fires = outs[name]
    if len(fires) != burst or any(kinds[f] != "threshold" for f in fires):
        what = "an I node must feed exactly one Threshold" if burst == 1 else \
            f"an I node of burst {burst} must feed exactly {burst} Thresholds"
        raise NIRError(f"node '{name}': {what} (the subtractive neuron pattern {pattern}); it feeds {fires}")
    for fire in fires:
        if ins[fire] != [name]:
            raise NIRError(f"node '{fire}': the neuron's Threshold must receive only '{name}', "
                           f"got {ins[fire]}")
    out = fires[0]
    if burst > 1:
        sums = outs[fires[0]]
        out = sums[0] if len(sums) == 1 else ""
        if not out or kinds[out] != "scale" or _meta(nodes[out]).get(OP_KEY) != SUM_OP \
                or any(outs[f] != [out] for f in fires) or sorted(ins[out]) != sorted(fires):
            raise NIRError(f"node '{name}': the spikes of its {burst} Thresholds must go only into "
                           f"one Scale of ones marked snnconv_op='sum' that receives only them "
                           f"(the burst neuron pattern {pattern})")
    resets = [s for s in outs[out] if kinds[s] == "scale" and outs[s] == [name]]
    if len(resets) != 1:
        raise NIRError(f"node '{name}': no single reset Scale from '{out}' back into "
                       f"'{name}' (found {resets}); a bare I node has no exact spiking meaning")
    reset = resets[0]
    if ins[reset] != [out]:
        raise NIRError(f"node '{reset}': the reset Scale must receive only '{out}', got {ins[reset]}")
    v_meta = meta.get("v_init")
    calibrated = isinstance(v_meta, (list, tuple, np.ndarray))
    _check_neuron_meta(name, {k: (0.5 if calibrated and k == "v_init" else v) for k, v in meta.items()},
                       "subtract", 0.5, required=True)
    scale = _array(nodes[reset].scale, reset, "scale")
    thresholds = [_array(nodes[f].threshold, f, "threshold") for f in fires]
    if any(not (scale.shape == t.shape == r.shape) for t in thresholds):
        raise NIRError(f"node '{name}': the neuron's shapes disagree: I {r.shape}, Threshold(s) "
                       f"{[t.shape for t in thresholds]}, Scale '{reset}' {scale.shape}")
    theta_full = -scale
    if (theta_full <= 0).any():
        raise NIRError(f"node '{reset}': the reset Scale must be -theta with theta > 0; "
                       f"found max {float(scale.max())!r}. Non-positive thresholds are refused")
    v0: Any = np.float32(0.5)
    if calibrated:
        v0 = np.asarray(v_meta, dtype=np.float64)
        if v0.shape == (1,):
            v0 = v0.reshape(())  # one value for the layer
        if v0.ndim > 1 or (v0.ndim == 1 and v0.shape[0] != r.shape[0]) \
                or not np.isfinite(v0).all() or (v0 < 0).any() or (v0 > 1).any():
            raise NIRError(f"node '{name}': metadata v_init must be a number or one value "
                           f"per channel ({r.shape[0]}), each in [0, 1]; got shape {v0.shape}")
        v0 = v0.astype(np.float32)
    v_full = np.broadcast_to(v0.reshape(v0.shape + (1,) * (len(r.shape) - v0.ndim)), r.shape)
    # the k-th Threshold in edge order fires the k-th spike of a step
    for k, (fire, threshold) in enumerate(zip(fires, thresholds), start=1):
        expected = spec_threshold(fire_threshold(theta_full, v_full, k))
        if not np.array_equal(threshold, expected):
            raise NIRError(f"node '{fire}': threshold must be exactly theta * ({k} - v_init) "
                           f"(one float32 step below it, compared with >) (theta = -scale of "
                           f"'{reset}', v_init from the metadata: "
                           f"{'calibrated' if calibrated else '1/2'}); it is not")
    params = {"theta": _theta_compact(theta_full, name, per_channel), "reset": "subtract", "v_init": v0}
    if burst > 1:
        params["burst"] = burst
    return params, out, reset


#: The node kinds of snnconv's IF neuron (NIR's IF, or the I/Threshold pattern read in parse()).
_NEURON_NODES = {"IF": "if", "I": "integrator", "Threshold": "threshold"}
#: NIR node type -> node kind: the op it is read as (:data:`snnconv.nir.ops.OPS`), or a neuron part.
_NODE_KINDS: tuple[tuple[type, str], ...] = tuple(
    (getattr(nir, node) if hasattr(nir, node) else getattr(nir.ir.graph, node), _NEURON_NODES.get(node, op))
    for op, kind in OPS.items() for node in kind.nodes)


def _node_kind(name: str, node: Any) -> str:
    if isinstance(node, nir.NIRGraph):
        raise NIRError(f"node '{name}' is a nested NIRGraph; snnconv reads flat graphs only "
                       "(inline the subgraph's nodes and edges)")
    for cls, kind in _NODE_KINDS:
        if type(node) is cls:  # exact: a subclass may mean something else
            return kind
    raise NIRError(f"node '{name}' has type {type(node).__name__}, which snnconv cannot run "
                   f"exactly. Supported: {_SUPPORTED}")


def _edges(graph: Any) -> list[tuple[str, str]]:
    edges = []
    seen = set()
    for i, edge in enumerate(list(getattr(graph, "edges", None) or [])):
        try:
            src, dst = edge
        except (TypeError, ValueError):
            raise NIRError(f"edge #{i} is {edge!r}, not a (source, target) pair") from None
        src, dst = (e.decode("utf8") if isinstance(e, bytes) else e for e in (src, dst))
        if not isinstance(src, str) or not isinstance(dst, str):
            raise NIRError(f"edge #{i} ({src!r} -> {dst!r}) does not name two nodes")
        for end, role in ((src, "source"), (dst, "target")):
            if end not in graph.nodes:
                raise NIRError(f"dangling edge '{src}' -> '{dst}': its {role} '{end}' is not a node of "
                               "the graph")
        if (src, dst) in seen:
            raise NIRError(f"edge '{src}' -> '{dst}' appears twice; a node's inputs are summed, so "
                           "a repeated edge would count its source twice. Remove the duplicate.")
        seen.add((src, dst))
        edges.append((src, dst))
    return edges


def parse(graph: "nir.NIRGraph", *, dt: float = 1.0, compare: str | None = None) -> ParsedGraph:
    """Read ``graph`` strictly: ops in topological order, shapes checked, neurons exact.

    A neuron node means what NIR's spec says (``IF`` fires on ``v > v_threshold`` and resets to
    ``v_reset``) unless snnconv's metadata states otherwise (see :mod:`snnconv.nir.format`); the
    ops' ``theta`` is always the threshold compared with ``>=``.

    Args:
        graph: the graph.
        dt: the time step it is read at (NIR is continuous time): an integrator ``I`` or ``IF``
            with resistance ``r`` integrates ``r * dt`` of its input per step, which must be 1.
            snnconv's files have ``r = 1`` (``dt = 1``), spikingjelly's default ``r = 1e4``.
        compare: the comparison of ``IF`` nodes that state none: ``None`` (NIR's ``">"``), or
            ``">="`` for files whose producer simulates ``v >= v_threshold`` against the spec
            (spikingjelly, sinabs), to reproduce that producer's own simulation at ties.

    Raises:
        NIRError: naming the node or edge, for an unknown node type, a dangling or duplicate
            edge, inconsistent shapes, a cycle other than the subtractive neuron's reset loop,
            a missing or repeated Input/Output, a non-positive threshold, neurons that are not
            exactly snnconv's IF (``r * dt != 1``, a reset value or initial state it does not
            implement), mixed reset modes, an IF of a file older than ``v_reset`` (it resets by
            subtraction in absolute units) or an ``snnconv_format`` other than the one
            it reads.
    """
    dt, compare_default, metadata, legacy, source_version = _call(graph, dt, compare)
    nodes, kinds, edges, ins, outs, input_name, output_name = _structure(graph)
    n = _neurons(nodes, kinds, ins, outs, dt, compare_default, legacy, source_version)
    names, op_inputs, users = _op_inputs(nodes, kinds, ins, n, input_name, output_name)
    order = _topological(names, op_inputs, users, edges, n.alias, input_name)
    ops = _ops(order, nodes, kinds, op_inputs, n, dt)
    reset, T = _graph_facts(ops, metadata)
    return ParsedGraph(ops=tuple(ops), input_shape=ops[0].out_shape, output_shape=ops[-1].out_shape,
                       reset=reset, T=T, metadata=MappingProxyType(metadata))


def _call(graph: Any, dt: Any, compare: str | None) -> tuple[float, str, dict, bool | None, Any]:
    """The call's arguments checked, the graph's metadata and whether it predates ``v_reset``."""
    if not isinstance(graph, nir.NIRGraph):
        raise NIRError(f"expected a nir.NIRGraph, got {type(graph).__name__}")
    if isinstance(dt, bool) or not isinstance(dt, (int, float, np.floating)) \
            or not math.isfinite(float(dt)) or dt <= 0:
        raise NIRError(f"dt must be a positive finite number (the time step), got {dt!r}")
    dt = float(dt)
    compare_default = SPEC_COMPARE if compare is None else compare
    if compare_default not in COMPARES:
        raise NIRError(f"compare must be None or one of {COMPARES}, got {compare!r}")
    metadata = _meta(graph)
    fmt = metadata.get("snnconv_format")
    if fmt is not None and (isinstance(fmt, bool) or fmt != FORMAT_VERSION):
        raise NIRError(f"graph metadata snnconv_format={fmt!r}: this snnconv reads format "
                       f"{FORMAT_VERSION} only. Re-export the network with this snnconv (convert the "
                       "model again and write it with export_nir or save_nir)")
    source_version = metadata.get(SOURCE_VERSION_KEY)
    legacy = predates_v_reset(source_version)
    return dt, compare_default, metadata, legacy, source_version


def _structure(graph: Any) -> tuple[dict, dict[str, str], list[tuple[str, str]], dict[str, list[str]],
                                     dict[str, list[str]], str, str]:
    """The nodes, their kinds, the edges (each node's inputs and users) and the one Input and
    Output."""
    nodes = getattr(graph, "nodes", None)
    if not isinstance(nodes, dict) or not nodes:
        raise NIRError("the NIR graph has no nodes")
    for name in nodes:
        if not isinstance(name, str) or not name:
            raise NIRError(f"node name {name!r} is not a non-empty string")
    kinds = {name: _node_kind(name, node) for name, node in nodes.items()}
    edges = _edges(graph)
    ins: dict[str, list[str]] = {n: [] for n in nodes}
    outs: dict[str, list[str]] = {n: [] for n in nodes}
    for src, dst in edges:
        ins[dst].append(src)
        outs[src].append(dst)

    for role in ("input", "output"):
        found = [n for n, k in kinds.items() if k == role]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} ({', '.join(found)})"
            raise NIRError(f"the graph has {what} {role.capitalize()} node(s); snnconv reads graphs "
                           f"with exactly one Input and one Output")
    (input_name,) = [n for n, k in kinds.items() if k == "input"]
    (output_name,) = [n for n, k in kinds.items() if k == "output"]
    if ins[input_name]:
        raise NIRError(f"edge '{ins[input_name][0]}' -> '{input_name}' leads into the Input node")
    if outs[output_name]:
        raise NIRError(f"edge '{output_name}' -> '{outs[output_name][0]}' leaves the Output node")
    return nodes, kinds, edges, ins, outs, input_name, output_name


@dataclass
class _Neurons:
    """The neurons of a graph: each one's params and shape, a Threshold's neuron (``alias``), an
    integrator's reset Scale (``own_reset``) and the nodes folded into neurons (``hidden``)."""

    alias: dict[str, str]
    own_reset: dict[str, str]
    hidden: set[str]
    params: dict[str, dict[str, Any]]
    shapes: dict[str, tuple[int, ...]]


def _neurons(nodes: dict, kinds: dict[str, str], ins: dict[str, list[str]], outs: dict[str, list[str]],
             dt: float, compare_default: str, legacy: bool | None, source_version: Any) -> _Neurons:
    """Collapse I -> Threshold -> Scale -> I into one op; read IF nodes."""
    alias: dict[str, str] = {}  # a Threshold's name -> its neuron's name
    own_reset: dict[str, str] = {}  # an integrator's name -> its reset Scale's name
    hidden: set[str] = set()  # Threshold and reset Scale nodes folded into a neuron
    neuron_params: dict[str, dict[str, Any]] = {}
    neuron_shapes: dict[str, tuple[int, ...]] = {}
    for name, kind in kinds.items():
        node = nodes[name]
        meta = _meta(node)
        granularity = meta.get("threshold")
        per_channel = {"per_channel": True, "per_layer": False}.get(granularity) \
            if isinstance(granularity, str) else None
        if kind == "integrator":
            params, fire, reset = _read_subtractive(name, node, meta, per_channel, dt, nodes, kinds,
                                                    ins, outs)
            neuron_params[name] = params
            neuron_shapes[name] = _array(node.r, name, "r").shape
            alias[fire] = name
            own_reset[name] = reset
            hidden.update((*outs[name], fire, reset))  # the Threshold(s), a burst's sum, the reset
        elif kind == "if":
            r = _array(node.r, name, "r")
            v_th = _array(node.v_threshold, name, "v_threshold")
            v_reset = _array(node.v_reset if node.v_reset is not None else np.zeros_like(v_th),
                             name, "v_reset")
            if not (r.shape == v_th.shape == v_reset.shape):
                raise NIRError(f"node '{name}': IF parameter shapes disagree: r {r.shape}, "
                               f"v_threshold {v_th.shape}, v_reset {v_reset.shape}")
            if legacy and NEURON_KEY not in meta:
                raise NIRError(legacy_if_reason(name, source_version))
            _check_gain(name, r, dt, "an IF")
            if (v_reset != 0).any():
                raise NIRError(f"node '{name}': IF with v_reset != 0; snnconv's hard-reset neuron "
                               "resets to 0")
            _check_neuron_meta(name, meta, "zero", 0.0, required=False)
            compare = meta.get("compare", compare_default)
            neuron_params[name] = {"theta": _theta_compact(engine_threshold(v_th, compare), name,
                                                           per_channel), "reset": "zero"}
            neuron_shapes[name] = r.shape
    for name, kind in kinds.items():
        if kind == "threshold" and name not in hidden:
            raise NIRError(f"node '{name}': a Threshold outside the I -> Threshold -> Scale(-theta) -> I "
                           "neuron pattern; snnconv has no exact meaning for it")
    return _Neurons(alias, own_reset, hidden, neuron_params, neuron_shapes)


def _op_inputs(nodes: dict, kinds: dict[str, str], ins: dict[str, list[str]], n: _Neurons, input_name: str,
               output_name: str) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
    """The ops (nodes not folded into a neuron), each one's inputs in edge order and its users."""
    alias, own_reset, hidden = n.alias, n.own_reset, n.hidden
    names = [n for n in nodes if n not in hidden]
    op_inputs: dict[str, list[str]] = {}
    users: dict[str, list[str]] = {n: [] for n in names}
    for name in names:
        # an integrator's own reset edge is its neuron's recurrence, not an input
        srcs = [s for s in ins[name] if s != own_reset.get(name)]
        for s in srcs:
            if s in hidden and s not in alias:
                raise NIRError(f"edge '{s}' -> '{name}': the reset Scale '{s}' may feed only its "
                               "own integrator")
            if s in alias and kinds[name] == "integrator":
                raise NIRError(f"edge '{s}' -> '{name}': the spikes of neuron '{alias[s]}' go "
                               f"straight into the integrator of neuron '{name}', without a "
                               "synapse; snnconv reads an I node's inputs only from synapse, "
                               "pooling or sum nodes (and its own reset Scale). Route them "
                               "through a node (e.g. a Scale of ones) or remove the edge")
        op_inputs[name] = [alias.get(s, s) for s in srcs]
        for s in op_inputs[name]:
            users[s].append(name)
    for name in names:
        if name != input_name and not op_inputs[name]:
            raise NIRError(f"node '{name}' has no incoming edge; every node except the Input must "
                           "be fed")
        if name != output_name and not users[name]:
            raise NIRError(f"node '{name}': its output goes nowhere (no edge from it to another "
                           "node); connect it or remove it")
    return names, op_inputs, users


def _topological(names: list[str], op_inputs: dict[str, list[str]], users: dict[str, list[str]],
                 edges: list[tuple[str, str]], alias: dict[str, str], input_name: str) -> list[str]:
    """The ops in topological order (Kahn; ties broken by first appearance in the edge list)."""
    rank = {input_name: -1}
    for i, (src, dst) in enumerate(edges):
        for n in (alias.get(src, src), alias.get(dst, dst)):
            rank.setdefault(n, i)
    pending = {n: len(op_inputs[n]) for n in names}
    heap = [(rank.get(n, len(edges)), n) for n in names if pending[n] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for u in users[n]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, (rank.get(u, len(edges)), u))
    if len(order) != len(names):
        stuck = [n for n in names if pending[n] > 0]
        n = stuck[0]
        src = next(s for s in op_inputs[n] if s in stuck)
        raise NIRError(f"the graph has a cycle through edge '{src}' -> '{n}' (nodes "
                       f"{', '.join(stuck)}); the only recurrence snnconv reads is a subtractive "
                       "neuron's reset edge X_fire -> X_reset -> X")
    return order


def _ops(order: list[str], nodes: dict, kinds: dict[str, str], op_inputs: dict[str, list[str]], n: _Neurons,
         dt: float) -> list[Op]:
    """Each op's shapes and params, in order (every edge's shape checked)."""
    neuron_params, neuron_shapes = n.params, n.shapes
    out_shape: dict[str, tuple[int, ...]] = {}
    ops: list[Op] = []
    for name in order:
        node = nodes[name]
        kind = kinds[name]
        in_names = tuple(op_inputs[name])
        incoming = None
        if in_names:
            incoming = out_shape[in_names[0]]
            for s in in_names[1:]:
                if out_shape[s] != incoming:
                    raise NIRError(f"inconsistent shapes into '{name}': edge '{in_names[0]}' -> '{name}' "
                                   f"brings {incoming}, edge '{s}' -> '{name}' brings {out_shape[s]}; "
                                   "summed inputs must have one shape")
        if kind in LEAKY_KINDS:
            kind, params, in_shape, shape = read_leaky(name, node, kind, dt)
        else:
            kind, params, in_shape, shape = read_op(name, node, kind, incoming,
                                                     neuron_params.get(name), neuron_shapes.get(name))
        if incoming is not None and in_shape != incoming:
            raise NIRError(f"inconsistent shapes on edge '{in_names[0]}' -> '{name}': it brings "
                           f"{incoming}, node '{name}' ({type(node).__name__}) takes {in_shape}")
        out_shape[name] = shape
        ops.append(Op(name=name, kind=kind, inputs=in_names, params=MappingProxyType(params),
                      in_shape=in_shape, out_shape=shape))
    return ops


def _graph_facts(ops: list[Op], metadata: dict) -> tuple[str, int | None]:
    """The network's one reset mode (checked against the metadata's) and its T, if recorded."""
    reset_by = {op.params["reset"]: op.name for op in ops if op.kind == "neuron"}
    if len(reset_by) > 1:
        raise NIRError(f"mixed reset modes: neuron '{reset_by['subtract']}' reset_by by subtraction, "
                       f"neuron '{reset_by['zero']}' reset_by to zero; snnconv runs one reset mode per "
                       "network")
    declared = metadata.get("reset")
    if declared is not None and declared not in RESETS:
        raise NIRError(f"graph metadata reset={declared!r}; expected one of {RESETS}")
    if reset_by and declared is not None and declared not in reset_by:
        raise NIRError(f"graph metadata says reset={declared!r}, but neuron "
                       f"'{next(iter(reset_by.values()))}' reset_by by "
                       f"{'subtraction' if 'subtract' in reset_by else 'zero'}")
    reset = next(iter(reset_by)) if reset_by else (declared or "subtract")
    T = metadata.get("T")
    if T is not None:
        if isinstance(T, bool) or not isinstance(T, (int, float)) or not math.isfinite(T) \
                or T != int(T) or T < 1:
            raise NIRError(f"graph metadata T={T!r} is not a positive integer")
        T = int(T)
    return reset, T
