"""The op table of the dense executor: for each NIR op kind it runs, a builder that binds the
op's parameters to a device and dtype and returns the torch function of its batched input."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from snnconv.errors import BackendError
from snnconv.nir.ops import OPS, PASS, WEIGHTED, flatten_dims

__all__ = ["WEIGHTED", "PASS", "RUNNABLE", "OP_BUILDERS", "to_tensor", "flatten_dims"]

#: Every op kind the executor runs (neurons included): the whole vocabulary.
RUNNABLE = tuple(OPS)


def to_tensor(a: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An op parameter as a contiguous tensor of ``dtype`` on ``device``."""
    return torch.tensor(np.asarray(a)).to(device=device, dtype=dtype).contiguous()


def _broadcastable(scale: torch.Tensor, in_shape: Sequence[int], name: str) -> torch.Tensor:
    """A Scale's factor shaped to broadcast against a batched ``[N, *in_shape]`` tensor."""
    in_shape = tuple(in_shape)
    if scale.dim() == 0:
        return scale
    if scale.dim() == 1 and len(in_shape) >= 1 and scale.shape[0] == in_shape[0] and len(in_shape) > 1:
        return scale.reshape(-1, *([1] * (len(in_shape) - 1)))
    try:
        torch.broadcast_shapes(tuple(scale.shape), in_shape)
    except RuntimeError:
        raise BackendError(f"Scale node '{name}': factor of shape {tuple(scale.shape)} does not "
                           f"broadcast against its input {in_shape}") from None
    if len(scale.shape) > len(in_shape):
        raise BackendError(f"Scale node '{name}': factor of shape {tuple(scale.shape)} has more "
                           f"dimensions than its input {in_shape}")
    if scale.dim() >= 2:  # a per-channel factor written out over the whole map: keep [C, 1, ...]
        corner = scale[(slice(None),) + (slice(0, 1),) * (scale.dim() - 1)]
        if torch.equal(scale, corner.expand_as(scale)):
            return corner.contiguous()
    return scale


def _passes(op: Any, dt: torch.dtype, dev: torch.device) -> None:
    """Input, output and sum: the summed input passes on unchanged."""
    return None


def _conv(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    w, b = to_tensor(p["weight"], dt, dev), to_tensor(p["bias"], dt, dev)
    stride, padding, dilation, groups = (tuple(p["stride"]), tuple(p["padding"]),
                                         tuple(p["dilation"]), int(p["groups"]))
    conv = F.conv2d if op.kind == "conv2d" else F.conv1d
    return lambda x: conv(x, w, b, stride, padding, dilation, groups)


def _affine(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    w, b = to_tensor(p["weight"], dt, dev), to_tensor(p["bias"], dt, dev)
    return lambda x: F.linear(x, w, b)


def _linear(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    w = to_tensor(p["weight"], dt, dev)
    b = to_tensor(p["bias"], dt, dev) if "bias" in p else None
    return lambda x: F.linear(x, w, b)


def _avgpool(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    if p.get("adaptive", False):
        out_hw = tuple(op.out_shape[-2:])
        return lambda x: F.adaptive_avg_pool2d(x, out_hw)
    k, s, pad = tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"])
    return lambda x: F.avg_pool2d(x, k, s, pad)


def _sumpool(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    k, s, pad = tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"])
    return lambda x: F.avg_pool2d(x, k, s, pad, divisor_override=1)


def _flatten(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    a, e = flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
    return lambda x: x.flatten(a, e)


def _scale(op: Any, dt: torch.dtype, dev: torch.device) -> Callable:
    p = op.params
    scale = to_tensor(p["scale"], dt, dev)
    scale = _broadcastable(scale, op.in_shape, op.name)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    scaled.factor = scale  # type: ignore[attr-defined]  # read by the bound graph (a product of spikes)
    return scaled


#: NIR op kind -> ``builder(op, dtype, device)``: the function of the op's batched input (None:
#: the summed input passes on). Neurons are built by the bound graph, which holds the neuron update.
OP_BUILDERS: dict[str, Callable[[Any, torch.dtype, torch.device], Callable | None]] = {
    "input": _passes, "output": _passes, "sum": _passes,
    "conv1d": _conv, "conv2d": _conv, "affine": _affine, "linear": _linear,
    "avgpool2d": _avgpool, "sumpool2d": _sumpool, "flatten": _flatten, "scale": _scale,
}
