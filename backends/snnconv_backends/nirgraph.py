"""The strict NIR reader every snnconv executor shares: ``parse(graph) -> ParsedGraph``.

``parse`` turns a ``nir.NIRGraph`` (nir 1.0.8) into a flat tuple of :class:`Op` in topological
order, with batch-free shapes checked on every edge and the neurons rebuilt with their exact
discrete-time meaning. It never guesses: whatever it cannot read exactly is refused with
:class:`snnconv.errors.NIRError` naming the node or edge.

Neurons (both with ``theta`` per layer, shape ``()``, or per channel, shape ``(C,)``)::

    reset "subtract" (three standard nodes: X = I(r=1), X_fire = Threshold(theta/2),
    X_reset = Scale(-theta), edges X -> X_fire -> X_reset -> X):
        h[t] = v[t-1] + x[t] / theta;  s[t] = h[t] >= 1;  v[t] = h[t] - s[t];  v[0] = 1/2
    reset "zero" (one node X = IF(r=1, v_threshold=theta, v_reset=0)):
        h[t] = v[t-1] + x[t];  s[t] = h[t] >= theta;  v[t] = h[t] * (1 - s[t]);  v[0] = 0

The subtractive pattern is collapsed into one ``"neuron"`` op named ``X``; consumers of
``X_fire`` read ``X``'s spikes, and the reset edge is not an input. A node with several incoming
edges receives their sum, in edge order (``((a + b) + c)``). An ``Identity`` node, or a ``Scale``
of ones marked ``metadata["snnconv_op"] == "sum"`` (nir 1.0.8 cannot write ``Identity`` to a
file), becomes a ``"sum"`` op.

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
neuron          theta (shape ``()`` or ``(C,)``), reset ("subtract" | "zero")
lif, cubalif,   Euler coefficients at ``dt`` (:mod:`snnconv_backends.nirleaky`)
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
from snnconv.nirformat import (ADAPTIVE_AVGPOOL, COMPARE, FORMAT_VERSION, MODULE_KEY, OP_KEY, RESETS,
                               SUM_OP, fire_threshold)

from .nirleaky import LEAKY_KINDS, read_leaky

__all__ = ["Op", "ParsedGraph", "parse", "KINDS", "RESETS", "FORMAT_VERSION"]

KINDS = ("input", "conv1d", "conv2d", "affine", "linear", "avgpool2d", "sumpool2d", "flatten",
         "scale", "sum", "neuron", "output") + LEAKY_KINDS

_SUPPORTED = ("Input, Output, Conv1d, Conv2d, Affine, Linear, AvgPool2d, SumPool2d, Flatten, "
              "Scale, Identity, IF (r=1, v_reset=0) and the I/Threshold/Scale(-theta) neuron; "
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


# --- small readers ---------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Metadata as plain python: bytes -> str, numpy scalars -> python scalars."""
    if isinstance(value, bytes):
        return value.decode("utf8", errors="replace")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO" and value.ndim == 0:
        return _plain(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _meta(node: Any) -> dict[str, Any]:
    meta = getattr(node, "metadata", None)
    return _plain(meta) if isinstance(meta, dict) else {}


def _array(value: Any, where: str, what: str, ndim: int | None = None) -> np.ndarray:
    """``value`` as a finite float32 array (NIRError naming ``where``/``what`` otherwise)."""
    if value is None:
        raise NIRError(f"node '{where}': {what} is missing")
    try:
        arr = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 (anything that is not array-like)
        raise NIRError(f"node '{where}': {what} is not an array ({exc})") from exc
    if arr.dtype.kind not in "fiub":
        raise NIRError(f"node '{where}': {what} has dtype {arr.dtype}, not a number")
    arr = arr.astype(np.float32)
    if ndim is not None and arr.ndim != ndim:
        raise NIRError(f"node '{where}': {what} has shape {arr.shape}, expected {ndim} dimensions")
    if not np.isfinite(arr).all():
        raise NIRError(f"node '{where}': {what} holds {int((~np.isfinite(arr)).sum())} NaN/inf value(s)")
    arr.setflags(write=False)
    return arr


def _int(value: Any, where: str, what: str, minimum: int | None = None) -> int:
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "iuf" or float(arr.reshape(-1)[0]) != int(arr.reshape(-1)[0]):
        raise NIRError(f"node '{where}': {what} must be one integer, got {value!r}")
    out = int(arr.reshape(-1)[0])
    if minimum is not None and out < minimum:
        raise NIRError(f"node '{where}': {what} must be >= {minimum}, got {out}")
    return out


def _ints(value: Any, n: int, where: str, what: str, minimum: int = 0) -> tuple[int, ...]:
    """An int or ``n`` ints as an ``n``-tuple."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf" or arr.size not in (1, n) or arr.ndim > 1:
        raise NIRError(f"node '{where}': {what} must be an integer or {n} integers, got {value!r}")
    flat = [float(v) for v in arr.reshape(-1)]
    if any(v != int(v) or v < minimum for v in flat):
        raise NIRError(f"node '{where}': {what} must hold integers >= {minimum}, got {value!r}")
    vals = tuple(int(v) for v in flat)
    return vals * n if len(vals) == 1 else vals


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    if value is None:
        raise NIRError(f"node '{where}': {what} is missing")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf" or arr.ndim > 1 or arr.size == 0:
        raise NIRError(f"node '{where}': {what} is not a shape: {value!r}")
    shape = tuple(int(v) for v in arr.reshape(-1))
    if any(s < 1 or s != v for s, v in zip(shape, arr.reshape(-1))):
        raise NIRError(f"node '{where}': {what} must hold positive integers, got {value!r}")
    return shape


def _type_shape(types: Any, key: str, where: str) -> tuple[int, ...] | None:
    if not isinstance(types, dict) or types.get(key) is None:
        return None
    return _shape(types[key], where, f"{key} type")


def _window_out(n: int, k: int, s: int, p: int, d: int, where: str) -> int:
    out = (n + 2 * p - d * (k - 1) - 1) // s + 1
    if out < 1:
        raise NIRError(f"node '{where}': a window of {k} (stride {s}, padding {p}, dilation {d}) "
                       f"does not fit an input of size {n}")
    return out


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
    expected = {"reset": reset, "v_init": v_init, "compare": COMPARE}
    for key, want in expected.items():
        if key not in meta:
            if required:
                raise NIRError(
                    f"node '{where}': neuron metadata lacks {key!r} (expected {want!r}). The "
                    "I/Threshold/Scale pattern is read as snnconv's subtractive IF only when the "
                    "integrator's metadata says so (NIR's Threshold alone fires on '>')")
            continue
        got = meta[key]
        same = (abs(float(got) - want) == 0.0) if isinstance(want, float) and isinstance(got, (int, float)) \
            else got == want
        if not same:
            raise NIRError(f"node '{where}': neuron metadata {key}={got!r}, but snnconv reads this "
                           f"node only with {key}={want!r}")


# --- the parser --------------------------------------------------------------------------------

_NODE_KINDS: tuple[tuple[type, str], ...] = (
    (nir.Input, "input"), (nir.Output, "output"), (nir.Conv1d, "conv1d"), (nir.Conv2d, "conv2d"),
    (nir.Affine, "affine"), (nir.Linear, "linear"), (nir.AvgPool2d, "avgpool2d"),
    (nir.SumPool2d, "sumpool2d"), (nir.Flatten, "flatten"), (nir.Scale, "scale"),
    (nir.ir.graph.Identity, "sum"), (nir.I, "integrator"), (nir.Threshold, "threshold"),
    (nir.IF, "if"),
    (nir.LIF, "lif"), (nir.CubaLIF, "cubalif"), (nir.LI, "li"),
)


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


def parse(graph: "nir.NIRGraph", *, dt: float = 1.0) -> ParsedGraph:
    """Read ``graph`` strictly: ops in topological order, shapes checked, neurons exact.

    Raises:
        NIRError: naming the node or edge, for an unknown node type, a dangling or duplicate
            edge, inconsistent shapes, a cycle other than the subtractive neuron's reset loop,
            a missing or repeated Input/Output, a non-positive threshold, neurons that are not
            exactly snnconv's IF (``r != 1``, a reset value or initial state it does not
            implement) or mixed reset modes.
    """
    if not isinstance(graph, nir.NIRGraph):
        raise NIRError(f"expected a nir.NIRGraph, got {type(graph).__name__}")
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

    # --- neurons: collapse I -> Threshold -> Scale -> I into one op; read IF nodes ---
    alias: dict[str, str] = {}  # a Threshold's name -> its neuron's name
    hidden: set[str] = set()  # Threshold and reset Scale nodes folded into a neuron
    neuron_params: dict[str, dict[str, Any]] = {}
    neuron_shapes: dict[str, tuple[int, ...]] = {}
    for name, kind in kinds.items():
        node = nodes[name]
        meta = _meta(node)
        per_channel = {"per_channel": True, "per_layer": False}.get(meta.get("threshold"))
        if kind == "integrator":
            r = _array(node.r, name, "r")
            if (r != 1).any():
                raise NIRError(f"node '{name}': integrator with r != 1; snnconv's neurons integrate "
                               "their input once per step (r = 1 = 1/dt)")
            fire = outs[name]
            if len(fire) != 1 or kinds[fire[0]] != "threshold":
                raise NIRError(
                    f"node '{name}': an I node must feed exactly one Threshold (the subtractive "
                    f"neuron pattern I -> Threshold -> Scale(-theta) -> I); it feeds {fire}")
            fire = fire[0]
            if ins[fire] != [name]:
                raise NIRError(f"node '{fire}': the neuron's Threshold must receive only '{name}', "
                               f"got {ins[fire]}")
            resets = [s for s in outs[fire] if kinds[s] == "scale" and outs[s] == [name]]
            if len(resets) != 1:
                raise NIRError(f"node '{name}': no single reset Scale from '{fire}' back into "
                               f"'{name}' (found {resets}); a bare I node has no exact spiking meaning")
            reset = resets[0]
            if ins[reset] != [fire]:
                raise NIRError(f"node '{reset}': the reset Scale must receive only '{fire}', got "
                               f"{ins[reset]}")
            v_meta = meta.get("v_init")
            calibrated = isinstance(v_meta, (list, tuple, np.ndarray))
            _check_neuron_meta(name, {k: (0.5 if calibrated and k == "v_init" else v) for k, v in meta.items()},
                               "subtract", 0.5, required=True)
            scale = _array(nodes[reset].scale, reset, "scale")
            threshold = _array(nodes[fire].threshold, fire, "threshold")
            if not (scale.shape == threshold.shape == r.shape):
                raise NIRError(f"node '{name}': the neuron's shapes disagree: I {r.shape}, "
                               f"Threshold '{fire}' {threshold.shape}, Scale '{reset}' {scale.shape}")
            theta_full = -scale
            if (theta_full <= 0).any():
                raise NIRError(f"node '{reset}': the reset Scale must be -theta with theta > 0; "
                               f"found max {float(scale.max())!r}. Non-positive thresholds are refused")
            v0 = np.float32(0.5)
            if calibrated:
                v0 = np.asarray(v_meta, dtype=np.float64)
                if v0.shape == (1,):
                    v0 = v0.reshape(())  # one value for the layer
                if v0.ndim > 1 or (v0.ndim == 1 and v0.shape[0] != r.shape[0]) \
                        or not np.isfinite(v0).all() or (v0 < 0).any() or (v0 > 1).any():
                    raise NIRError(f"node '{name}': metadata v_init must be a number or one value "
                                   f"per channel ({r.shape[0]}), each in [0, 1]; got shape "
                                   f"{v0.shape}")
                v0 = v0.astype(np.float32)
            v_full = np.broadcast_to(v0.reshape(v0.shape + (1,) * (len(r.shape) - v0.ndim)), r.shape)
            if not np.array_equal(threshold, fire_threshold(theta_full, v_full)):
                raise NIRError(f"node '{fire}': threshold must be exactly theta * (1 - v_init) "
                               f"(theta = -scale of '{reset}', v_init from the metadata: "
                               f"{'calibrated' if calibrated else '1/2'}); it is not")
            neuron_params[name] = {"theta": _theta_compact(theta_full, name, per_channel),
                                   "reset": "subtract", "v_init": v0}
            neuron_shapes[name] = r.shape
            alias[fire] = name
            hidden.update((fire, reset))
        elif kind == "if":
            r = _array(node.r, name, "r")
            v_th = _array(node.v_threshold, name, "v_threshold")
            v_reset = _array(node.v_reset if node.v_reset is not None else np.zeros_like(v_th),
                             name, "v_reset")
            if not (r.shape == v_th.shape == v_reset.shape):
                raise NIRError(f"node '{name}': IF parameter shapes disagree: r {r.shape}, "
                               f"v_threshold {v_th.shape}, v_reset {v_reset.shape}")
            if (r != 1).any():
                raise NIRError(f"node '{name}': IF with r != 1; snnconv reads IF nodes with r = 1 "
                               "(= 1/dt, one integration per step)")
            if (v_reset != 0).any():
                raise NIRError(f"node '{name}': IF with v_reset != 0; snnconv's hard-reset neuron "
                               "resets to 0")
            _check_neuron_meta(name, meta, "zero", 0.0, required=False)
            neuron_params[name] = {"theta": _theta_compact(v_th, name, per_channel), "reset": "zero"}
            neuron_shapes[name] = r.shape
    for name, kind in kinds.items():
        if kind == "threshold" and name not in hidden:
            raise NIRError(f"node '{name}': a Threshold outside the I -> Threshold -> Scale(-theta) -> I "
                           "neuron pattern; snnconv has no exact meaning for it")

    # --- op inputs, in edge order ---
    names = [n for n in nodes if n not in hidden]
    op_inputs: dict[str, list[str]] = {}
    users: dict[str, list[str]] = {n: [] for n in names}
    for name in names:
        srcs = [s for s in ins[name] if not (kinds[name] == "integrator" and s in hidden)]
        for s in srcs:
            if s in hidden and s not in alias:
                raise NIRError(f"edge '{s}' -> '{name}': the reset Scale '{s}' may feed only its "
                               "own integrator")
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

    # --- topological order (Kahn; ties broken by first appearance in the edge list) ---
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

    # --- shapes and params, in order ---
    out_shape: dict[str, tuple[int, ...]] = {}
    ops: list[Op] = []
    for name in order:
        node = nodes[name]
        kind = kinds[name]
        srcs = tuple(op_inputs[name])
        incoming = None
        if srcs:
            incoming = out_shape[srcs[0]]
            for s in srcs[1:]:
                if out_shape[s] != incoming:
                    raise NIRError(f"inconsistent shapes into '{name}': edge '{srcs[0]}' -> '{name}' "
                                   f"brings {incoming}, edge '{s}' -> '{name}' brings {out_shape[s]}; "
                                   "summed inputs must have one shape")
        if kind in LEAKY_KINDS:
            kind, params, in_shape, shape = read_leaky(name, node, kind, dt)
        else:
            kind, params, in_shape, shape = _read_op(name, node, kind, incoming,
                                                     neuron_params.get(name), neuron_shapes.get(name))
        if incoming is not None and in_shape != incoming:
            raise NIRError(f"inconsistent shapes on edge '{srcs[0]}' -> '{name}': it brings "
                           f"{incoming}, node '{name}' ({type(node).__name__}) takes {in_shape}")
        out_shape[name] = shape
        ops.append(Op(name=name, kind=kind, inputs=srcs, params=MappingProxyType(params),
                      in_shape=in_shape, out_shape=shape))

    # --- graph-level facts ---
    metadata = _meta(graph)
    resets = {op.params["reset"]: op.name for op in ops if op.kind == "neuron"}
    if len(resets) > 1:
        raise NIRError(f"mixed reset modes: neuron '{resets['subtract']}' resets by subtraction, "
                       f"neuron '{resets['zero']}' resets to zero; snnconv runs one reset mode per "
                       "network")
    declared = metadata.get("reset")
    if declared is not None and declared not in RESETS:
        raise NIRError(f"graph metadata reset={declared!r}; expected one of {RESETS}")
    if resets and declared is not None and declared not in resets:
        raise NIRError(f"graph metadata says reset={declared!r}, but neuron "
                       f"'{next(iter(resets.values()))}' resets by "
                       f"{'subtraction' if 'subtract' in resets else 'zero'}")
    reset = next(iter(resets)) if resets else (declared or "subtract")
    T = metadata.get("T")
    if T is not None:
        if isinstance(T, bool) or not isinstance(T, (int, float)) or T != int(T) or T < 1:
            raise NIRError(f"graph metadata T={T!r} is not a positive integer")
        T = int(T)
    return ParsedGraph(ops=tuple(ops), input_shape=ops[0].out_shape, output_shape=ops[-1].out_shape,
                       reset=reset, T=T, metadata=MappingProxyType(metadata))


def _conv_params(name: str, node: Any, nd: int, incoming: tuple[int, ...] | None):
    weight = _array(node.weight, name, "weight", ndim=2 + nd)
    c_out, c_in_g, *kernel = weight.shape
    groups = _int(node.groups, name, "groups", minimum=1)
    if c_out % groups:
        raise NIRError(f"node '{name}': {c_out} output channels are not divisible by groups={groups}")
    bias = node.bias
    bias = np.zeros(c_out, np.float32) if bias is None else _array(bias, name, "bias")
    if bias.shape != (c_out,):
        raise NIRError(f"node '{name}': bias has shape {bias.shape}, expected ({c_out},)")
    stride = _ints(node.stride, nd, name, "stride", minimum=1)
    dilation = _ints(node.dilation, nd, name, "dilation", minimum=1)
    padding = node.padding
    if isinstance(padding, bytes):
        padding = padding.decode()
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0,) * nd
        elif padding == "same" and all(s == 1 for s in stride) and all(
                d * (k - 1) % 2 == 0 for d, k in zip(dilation, kernel)):
            padding = tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))
        else:
            raise NIRError(f"node '{name}': padding {padding!r} with stride {stride} and kernel "
                           f"{tuple(kernel)} has no symmetric integer padding")
    else:
        padding = _ints(padding, nd, name, "padding")
    declared = node.input_shape
    spatial = None
    if declared is not None:
        spatial = _ints(declared, nd, name, "input_shape", minimum=1)
    if incoming is not None:
        if len(incoming) != nd + 1:
            raise NIRError(f"node '{name}': a {nd}-d convolution needs a (C, {'H, W' if nd == 2 else 'N'}) "
                           f"input; it receives {incoming}")
        if spatial is not None and tuple(incoming[1:]) != spatial:
            raise NIRError(f"node '{name}': input_shape {spatial} disagrees with the incoming shape "
                           f"{incoming}")
        spatial = tuple(incoming[1:])
    if spatial is None:
        raise NIRError(f"node '{name}': no input_shape and no incoming shape")
    in_shape = (c_in_g * groups, *spatial)
    out = tuple(_window_out(n, k, s, p, d, name)
                for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation))
    params = {"weight": weight, "bias": bias, "stride": stride, "padding": padding,
              "dilation": dilation, "groups": groups}
    return params, in_shape, (c_out, *out)


def _read_op(name: str, node: Any, kind: str, incoming: tuple[int, ...] | None,
             neuron: dict[str, Any] | None, neuron_shape: tuple[int, ...] | None):
    """(kind, params, in_shape, out_shape) of one node."""
    meta = _meta(node)
    if kind == "input":
        shape = _type_shape(getattr(node, "input_type", None), "input", name)
        if shape is None:
            raise NIRError(f"node '{name}': the Input node has no shape")
        return kind, {}, None, shape
    if kind == "output":
        shape = _type_shape(getattr(node, "output_type", None), "output", name)
        if shape is None:
            raise NIRError(f"node '{name}': the Output node has no shape")
        return kind, {}, shape, shape
    if kind in ("conv1d", "conv2d"):
        params, in_shape, shape = _conv_params(name, node, 1 if kind == "conv1d" else 2, incoming)
        return kind, params, in_shape, shape
    if kind in ("affine", "linear"):
        weight = _array(node.weight, name, "weight", ndim=2)
        params = {"weight": weight}
        if kind == "affine":
            bias = _array(node.bias, name, "bias")
            if bias.shape != (weight.shape[0],):
                raise NIRError(f"node '{name}': bias has shape {bias.shape}, expected ({weight.shape[0]},)")
            params["bias"] = bias
        return kind, params, (weight.shape[1],), (weight.shape[0],)
    if kind in ("avgpool2d", "sumpool2d"):
        kernel = _ints(node.kernel_size, 2, name, "kernel_size", minimum=1)
        stride = _ints(node.stride, 2, name, "stride", minimum=1)
        padding = _ints(node.padding, 2, name, "padding")
        if incoming is None or len(incoming) != 3:
            raise NIRError(f"node '{name}': 2-d pooling needs a (C, H, W) input; it receives {incoming}")
        if any(2 * p > k for p, k in zip(padding, kernel)):
            raise NIRError(f"node '{name}': padding {padding} is more than half the kernel {kernel}")
        out = tuple(_window_out(n, k, s, p, 1, name)
                    for n, k, s, p in zip(incoming[1:], kernel, stride, padding))
        params = {"kernel_size": kernel, "stride": stride, "padding": padding}
        if kind == "avgpool2d":
            adaptive = meta.get(MODULE_KEY) == ADAPTIVE_AVGPOOL
            if adaptive and not (stride == kernel and padding == (0, 0) and all(
                    n == k * o for n, k, o in zip(incoming[1:], kernel, out))):
                raise NIRError(f"node '{name}': marked AdaptiveAvgPool2d but kernel {kernel}, stride "
                               f"{stride}, padding {padding} do not tile the input {incoming}")
            params["adaptive"] = adaptive
        return kind, params, incoming, (incoming[0], *out)
    if kind == "flatten":
        declared = _type_shape(getattr(node, "input_type", None), "input", name)
        in_shape = declared if declared is not None else incoming
        if in_shape is None:
            raise NIRError(f"node '{name}': Flatten has no input shape")
        n = len(in_shape)
        start = _int(node.start_dim, name, "start_dim")
        end = _int(node.end_dim, name, "end_dim")
        s, e = start % n if -n <= start < n else None, end % n if -n <= end < n else None
        if s is None or e is None or s > e:
            raise NIRError(f"node '{name}': start_dim={start}, end_dim={end} do not fit its batch-free "
                           f"input {in_shape} (NIR shapes have no batch dimension: torch's "
                           "flatten(x, 1) is Flatten(start_dim=0))")
        out = (*in_shape[:s], math.prod(in_shape[s:e + 1]), *in_shape[e + 1:])
        return kind, {"start_dim": start, "end_dim": end}, in_shape, out
    if kind == "scale":
        scale = _array(node.scale, name, "scale")
        if scale.ndim == 0:
            raise NIRError(f"node '{name}': a Scale needs an array of the signal's shape")
        if meta.get(OP_KEY) == SUM_OP:
            if (scale != 1).any():
                raise NIRError(f"node '{name}': marked as a sum node but its scale is not all ones")
            return "sum", {}, scale.shape, scale.shape
        return kind, {"scale": scale}, scale.shape, scale.shape
    if kind == "sum":
        declared = _type_shape(getattr(node, "input_type", None), "input", name)
        shape = declared if declared is not None else incoming
        return kind, {}, shape, shape
    if kind in ("integrator", "if"):
        if neuron is None or neuron_shape is None:  # pragma: no cover (parse() sets both)
            raise NIRError(f"node '{name}': neuron parameters were not read")
        return "neuron", dict(neuron), neuron_shape, neuron_shape
    raise NIRError(f"node '{name}': cannot read a {kind!r} node here")  # pragma: no cover
