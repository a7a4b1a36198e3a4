"""Float evaluation of the linear NIR ops: the off-chip encoder (the static first layer) and the
composition of op chains into weight matrices."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError
from snnconv.nir.ops import LINEAR, flatten_dims

__all__ = ["LINEAR_KINDS", "convolve", "conv_params", "apply_op"]

#: Op kinds that are linear maps (the static encoder, and chains between two neurons).
LINEAR_KINDS = LINEAR


def convolve(x: torch.Tensor, w: torch.Tensor, p: Mapping[str, Any], b: torch.Tensor | None = None):
    """A 1-d or 2-d convolution of ``x`` with ``w`` (and bias ``b``) as :func:`conv_params` describes it."""
    fn = F.conv1d if p["ndim"] == 1 else F.conv2d
    return fn(x, w, b, tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]), int(p["groups"]))


def conv_params(op: Any) -> dict[str, Any]:
    """A conv op's ndim, stride, padding, dilation and groups."""
    p = op.params
    return {"ndim": 1 if op.kind == "conv1d" else 2, "stride": tuple(p["stride"]),
            "padding": tuple(p["padding"]), "dilation": tuple(p["dilation"]), "groups": int(p["groups"])}


def apply_op(op: Any, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``op`` on a batch ``x`` ``[N, *op.in_shape]`` (float32 or float64)."""
    p, k, dt, dev = op.params, op.kind, x.dtype, x.device
    if k in ("conv1d", "conv2d"):
        w = torch.as_tensor(np.array(p["weight"]), dtype=dt, device=dev)
        b = torch.as_tensor(np.array(p["bias"]), dtype=dt, device=dev) if bias else None
        return convolve(x, w, conv_params(op), b)
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
        a, e = flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
        return x.flatten(a, e)
    if k == "scale":
        return x * torch.as_tensor(np.array(p["scale"]), dtype=dt, device=dev)
    if k == "sum":
        return x
    raise BackendError(f"loihi2-sim: op '{op.name}' of kind {k!r} is not a linear op it can map")
