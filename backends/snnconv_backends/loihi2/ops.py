"""Float evaluation of the linear NIR ops: the off-chip encoder (the static first layer) and the
composition of op chains into weight matrices."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError
from snnconv.nir.ops import flatten_dims

__all__ = ["APPLY", "LINEAR_KINDS", "convolve", "conv_params", "apply_op"]

def convolve(x: torch.Tensor, w: torch.Tensor, p: Mapping[str, Any], b: torch.Tensor | None = None):
    """A 1-d or 2-d convolution of ``x`` with ``w`` (and bias ``b``) as :func:`conv_params` describes it."""
    fn = F.conv1d if p["ndim"] == 1 else F.conv2d
    return fn(x, w, b, tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]), int(p["groups"]))


def conv_params(op: Any) -> dict[str, Any]:
    """A conv op's ndim, stride, padding, dilation and groups."""
    p = op.params
    return {"ndim": 1 if op.kind == "conv1d" else 2, "stride": tuple(p["stride"]),
            "padding": tuple(p["padding"]), "dilation": tuple(p["dilation"]), "groups": int(p["groups"])}


def _conv(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    w = torch.as_tensor(np.array(p["weight"]), dtype=x.dtype, device=x.device)
    b = torch.as_tensor(np.array(p["bias"]), dtype=x.dtype, device=x.device) if bias else None
    return convolve(x, w, conv_params(op), b)


def _dense(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    y = x @ torch.as_tensor(np.array(p["weight"]), dtype=x.dtype, device=x.device).T
    if op.kind == "affine" and bias:
        y = y + torch.as_tensor(np.array(p["bias"]), dtype=x.dtype, device=x.device)
    return y


def _avgpool(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    if p.get("adaptive", False):
        return F.adaptive_avg_pool2d(x, tuple(op.out_shape[-2:]))
    return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]))


def _sumpool(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]), divisor_override=1)


def _flatten(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    a, e = flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
    return x.flatten(a, e)


def _scale(op: Any, x: torch.Tensor, p: Mapping[str, Any], bias: bool) -> torch.Tensor:
    return x * torch.as_tensor(np.array(p["scale"]), dtype=x.dtype, device=x.device)


#: linear op kind -> its float evaluation ``f(op, x, params, bias)``: the static encoder's ops,
#: and the chains between two neurons that compose into a population's synapses
APPLY: dict[str, Callable[[Any, torch.Tensor, Mapping[str, Any], bool], torch.Tensor]] = {
    "conv1d": _conv, "conv2d": _conv, "affine": _dense, "linear": _dense, "avgpool2d": _avgpool,
    "sumpool2d": _sumpool, "flatten": _flatten, "scale": _scale, "sum": lambda op, x, p, bias: x,
}

#: Op kinds that are linear maps (the static encoder, and chains between two neurons): those
#: :data:`APPLY` evaluates (the vocabulary test checks them against ``snnconv.nir.ops.LINEAR``).
LINEAR_KINDS = tuple(APPLY)


def apply_op(op: Any, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``op`` on a batch ``x`` ``[N, *op.in_shape]`` (float32 or float64)."""
    f = APPLY.get(op.kind)
    if f is None:
        raise BackendError(f"loihi2-sim: op '{op.name}' of kind {op.kind!r} is not a linear op it can map")
    return f(op, x, op.params, bias)
