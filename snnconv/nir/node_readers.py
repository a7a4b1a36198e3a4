"""The strict reader's readers of single NIR nodes: each gives ``(kind, params, in_shape,
out_shape)`` of one op from its node, its metadata and the shape that reaches it
(:func:`read_op`); :func:`snnconv.nir.reader.parse` reads the graph around them."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import numpy as np

from snnconv.errors import NIRError
from snnconv.nir.format import ADAPTIVE_AVGPOOL, CONCAT_OP, MODULE_KEY, OP_KEY, SCALE_OP, SUM_OP
from snnconv.nir.values import array as _array
from snnconv.nir.values import conv_params as _conv_params
from snnconv.nir.values import diagonal_scale as _diagonal_scale
from snnconv.nir.values import integer as _int
from snnconv.nir.values import integers as _ints
from snnconv.nir.values import meta as _meta
from snnconv.nir.values import type_shape as _type_shape
from snnconv.nir.values import window_out as _window_out

__all__ = ["read_op"]


# --- one reader per node kind: (name, node, kind, metadata, incoming shape) -> the op ----------

def _read_input(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    shape = _type_shape(getattr(node, "input_type", None), "input", name)
    if shape is None:
        raise NIRError(f"node '{name}': the Input node has no shape")
    return kind, {}, None, shape


def _read_output(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    shape = _type_shape(getattr(node, "output_type", None), "output", name)
    if shape is None:
        raise NIRError(f"node '{name}': the Output node has no shape")
    return kind, {}, shape, shape


def _read_conv(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    params, in_shape, shape = _conv_params(name, node, 1 if kind == "conv1d" else 2, incoming)
    if meta.get(OP_KEY) == SCALE_OP:
        return _diagonal_scale(name, params, in_shape, shape)
    if meta.get(OP_KEY) == CONCAT_OP:
        _placement(name, params)
    return kind, params, in_shape, shape


def _read_dense(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    weight = _array(node.weight, name, "weight", ndim=2)
    params = {"weight": weight}
    if kind == "affine":
        bias = _array(node.bias, name, "bias")
        if bias.shape != (weight.shape[0],):
            raise NIRError(f"node '{name}': bias has shape {bias.shape}, expected ({weight.shape[0]},)")
        params["bias"] = bias
    if meta.get(OP_KEY) == SCALE_OP:
        return _diagonal_scale(name, params, (weight.shape[1],), (weight.shape[0],))
    if meta.get(OP_KEY) == CONCAT_OP:
        _placement(name, params)
    return kind, params, (weight.shape[1],), (weight.shape[0],)


def _placement(name: str, params: dict) -> None:
    """A concatenation's part (``{"snnconv_op": "concat"}``): checked to be a one-hot placement
    (a 1x1 weight of zeros and ones, one one per input channel, at most one per output channel,
    no bias) and marked ``params["placement"] = True`` (its spikes pass on unchanged: the energy
    counts charge the weighted layer after it)."""
    w = np.asarray(params["weight"])
    bias = params.get("bias")
    m: Any = w.reshape(w.shape[0], -1) if w.ndim == 2 else w.reshape(w.shape[0], w.shape[1], -1)
    ok = (w.ndim == 2 or (m.shape[2] == 1 and params.get("groups", 1) == 1
                          and all(int(v) == 1 for v in np.ravel(params.get("stride", 1)))
                          and not np.any(params.get("padding", 0))))
    m = m.reshape(m.shape[0], m.shape[1])
    ok = ok and bool(np.isin(m, (0.0, 1.0)).all()) and bool((m.sum(0) == 1).all()) and bool((m.sum(1) <= 1).all())
    if not ok or (bias is not None and np.any(np.asarray(bias) != 0)):
        raise NIRError(f"node '{name}': marked as a concatenation's part ({OP_KEY}={CONCAT_OP!r}) but its "
                       "weight is not a one-hot 1x1 placement without bias")
    params["placement"] = True


def _read_pool(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    kernel = _ints(node.kernel_size, 2, name, "kernel_size", minimum=1)
    stride = _ints(node.stride, 2, name, "stride", minimum=1)
    padding = _ints(node.padding, 2, name, "padding")
    if incoming is None or len(incoming) != 3:
        raise NIRError(f"node '{name}': 2-d pooling needs a (C, H, W) input; it receives {incoming}")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise NIRError(f"node '{name}': padding {padding} is more than half the kernel {kernel}")
    out = tuple(_window_out(n, k, s, p, 1, name)
                for n, k, s, p in zip(incoming[1:], kernel, stride, padding))
    params: dict[str, Any] = {"kernel_size": kernel, "stride": stride, "padding": padding}
    if kind == "avgpool2d":
        adaptive = meta.get(MODULE_KEY) == ADAPTIVE_AVGPOOL
        if adaptive and not (stride == kernel and padding == (0, 0) and all(
                n == k * o for n, k, o in zip(incoming[1:], kernel, out))):
            raise NIRError(f"node '{name}': marked AdaptiveAvgPool2d but kernel {kernel}, stride "
                           f"{stride}, padding {padding} do not tile the input {incoming}")
        params["adaptive"] = adaptive
    return kind, params, incoming, (incoming[0], *out)


def _read_flatten(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
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


def _read_scale(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    scale = _array(node.scale, name, "scale")
    if scale.ndim == 0:
        raise NIRError(f"node '{name}': a Scale needs an array of the signal's shape")
    if meta.get(OP_KEY) == SUM_OP:
        if (scale != 1).any():
            raise NIRError(f"node '{name}': marked as a sum node but its scale is not all ones")
        return "sum", {}, scale.shape, scale.shape
    return kind, {"scale": scale}, scale.shape, scale.shape


def _read_sum(name: str, node: Any, kind: str, meta: dict, incoming: tuple[int, ...] | None):
    declared = _type_shape(getattr(node, "input_type", None), "input", name)
    shape = declared if declared is not None else incoming
    return kind, {}, shape, shape


#: node kind -> its reader (the neurons are read with their pattern, in parse())
_READERS = MappingProxyType({
    "input": _read_input, "output": _read_output, "conv1d": _read_conv, "conv2d": _read_conv,
    "affine": _read_dense, "linear": _read_dense, "avgpool2d": _read_pool, "sumpool2d": _read_pool,
    "flatten": _read_flatten, "scale": _read_scale, "sum": _read_sum,
})


def read_op(name: str, node: Any, kind: str, incoming: tuple[int, ...] | None,
             neuron: dict[str, Any] | None, neuron_shape: tuple[int, ...] | None):
    """(kind, params, in_shape, out_shape) of one node."""
    if kind in ("integrator", "if"):
        if neuron is None or neuron_shape is None:  # pragma: no cover (parse() sets both)
            raise NIRError(f"node '{name}': neuron parameters were not read")
        return "neuron", dict(neuron), neuron_shape, neuron_shape
    reader = _READERS.get(kind)
    if reader is None:  # pragma: no cover (parse() admits only the kinds of the node table)
        raise NIRError(f"node '{name}': cannot read a {kind!r} node here")
    return reader(name, node, kind, _meta(node), incoming)
