"""Values and layer parameters of NIR nodes, read strictly (the small readers of
:mod:`snnconv.nir.reader`): every value is checked and refused with
:class:`snnconv.errors.NIRError` naming the node."""

from __future__ import annotations

from typing import Any

import numpy as np

from snnconv.errors import NIRError
from snnconv.nir.format import OP_KEY, SCALE_OP

__all__ = ["plain", "meta", "array", "integer", "integers", "shape", "type_shape", "window_out",
           "conv_params", "diagonal_scale"]


def plain(value: Any) -> Any:
    """Metadata as plain python: bytes -> str, numpy scalars -> python scalars."""
    if isinstance(value, bytes):
        return value.decode("utf8", errors="replace")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO" and value.ndim == 0:
        return plain(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def meta(node: Any) -> dict[str, Any]:
    meta = getattr(node, "metadata", None)
    return plain(meta) if isinstance(meta, dict) else {}


def array(value: Any, where: str, what: str, ndim: int | None = None) -> np.ndarray:
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


def integer(value: Any, where: str, what: str, minimum: int | None = None) -> int:
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "iuf" or float(arr.reshape(-1)[0]) != int(arr.reshape(-1)[0]):
        raise NIRError(f"node '{where}': {what} must be one integer, got {value!r}")
    out = int(arr.reshape(-1)[0])
    if minimum is not None and out < minimum:
        raise NIRError(f"node '{where}': {what} must be >= {minimum}, got {out}")
    return out


def integers(value: Any, n: int, where: str, what: str, minimum: int = 0) -> tuple[int, ...]:
    """An int or ``n`` ints as an ``n``-tuple."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf" or arr.size not in (1, n) or arr.ndim > 1:
        raise NIRError(f"node '{where}': {what} must be an integer or {n} integers, got {value!r}")
    flat = [float(v) for v in arr.reshape(-1)]
    if any(v != int(v) or v < minimum for v in flat):
        raise NIRError(f"node '{where}': {what} must hold integers >= {minimum}, got {value!r}")
    vals = tuple(int(v) for v in flat)
    return vals * n if len(vals) == 1 else vals


def shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    if value is None:
        raise NIRError(f"node '{where}': {what} is missing")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf" or arr.ndim > 1 or arr.size == 0:
        raise NIRError(f"node '{where}': {what} is not a shape: {value!r}")
    shape = tuple(int(v) for v in arr.reshape(-1))
    if any(s < 1 or s != v for s, v in zip(shape, arr.reshape(-1))):
        raise NIRError(f"node '{where}': {what} must hold positive integers, got {value!r}")
    return shape


def type_shape(types: Any, key: str, where: str) -> tuple[int, ...] | None:
    if not isinstance(types, dict) or types.get(key) is None:
        return None
    return shape(types[key], where, f"{key} type")


def window_out(n: int, k: int, s: int, p: int, d: int, where: str) -> int:
    out = (n + 2 * p - d * (k - 1) - 1) // s + 1
    if out < 1:
        raise NIRError(f"node '{where}': a window of {k} (stride {s}, padding {p}, dilation {d}) "
                       f"does not fit an input of size {n}")
    return out


def conv_params(name: str, node: Any, nd: int, incoming: tuple[int, ...] | None):
    weight = array(node.weight, name, "weight", ndim=2 + nd)
    c_out, c_in_g, *kernel = weight.shape
    groups = integer(node.groups, name, "groups", minimum=1)
    if c_out % groups:
        raise NIRError(f"node '{name}': {c_out} output channels are not divisible by groups={groups}")
    bias = node.bias
    bias = np.zeros(c_out, np.float32) if bias is None else array(bias, name, "bias")
    if bias.shape != (c_out,):
        raise NIRError(f"node '{name}': bias has shape {bias.shape}, expected ({c_out},)")
    stride = integers(node.stride, nd, name, "stride", minimum=1)
    dilation = integers(node.dilation, nd, name, "dilation", minimum=1)
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
        padding = integers(padding, nd, name, "padding")
    declared = node.input_shape
    spatial = None
    if declared is not None:
        spatial = integers(declared, nd, name, "input_shape", minimum=1)
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
    out = tuple(window_out(n, k, s, p, d, name)
                for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation))
    params = {"weight": weight, "bias": bias, "stride": stride, "padding": padding,
              "dilation": dilation, "groups": groups}
    return params, in_shape, (c_out, *out)


def diagonal_scale(name: str, params: dict[str, Any], in_shape: tuple[int, ...],
                    out_shape: tuple[int, ...]):
    """A 1x1 convolution or a linear map marked ``snnconv_op = "scale"``: a per-channel scale
    (an identity shortcut written for readers without ``Scale``), checked to be exactly that."""
    w = np.asarray(params["weight"])
    c = w.shape[0]
    plain = (w.shape[:2] == (c, c) and all(k == 1 for k in w.shape[2:])
             and all(v == 1 for v in params.get("stride", (1,))) and not any(params.get("padding", (0,)))
             and params.get("groups", 1) == 1 and not np.any(params.get("bias", 0))
             and in_shape == out_shape)
    diag = np.diagonal(w.reshape(c, -1)[:, :c]) if plain else None
    if diag is None or not np.array_equal(w.reshape(c, c), np.diag(diag)):
        raise NIRError(f"node '{name}': marked {OP_KEY}={SCALE_OP!r} but not a square, unbiased "
                       "1x1 map with a diagonal weight")
    full = np.ascontiguousarray(np.broadcast_to(
        diag.reshape(c, *([1] * (len(out_shape) - 1))), out_shape), dtype=np.float32)
    full.setflags(write=False)
    return "scale", {"scale": full}, in_shape, out_shape
