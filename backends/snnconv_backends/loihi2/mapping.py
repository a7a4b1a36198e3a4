"""Mapping a parsed NIR graph onto populations and connections: which ops run off-chip, which op
chains connect two neurons, and how each chain runs (convolution, one-to-one, or a matrix)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch.nn import grad as nn_grad

from snnconv.errors import BackendError
from snnconv.nir.leaky import SPIKING
from snnconv.nir.reader import ParsedGraph
from snnconv_backends.loihi2.ops import LINEAR_KINDS, apply_op, conv_params

__all__ = ["Mapper", "chain_kind", "pool_then_conv", "conv_then_conv", "pair_as_conv", "chain_as_conv",
           "compose", "fanout"]


class Mapper:
    """A parsed graph read as populations and the op chains between them."""

    def __init__(self, g: ParsedGraph, backend: str = "loihi2-sim"):
        self.g = g
        self.backend = backend
        self.ops = {op.name: op for op in g.ops}
        self.static = self._static_names()

    def _static_names(self) -> set[str]:
        static = set()
        for op in self.g.ops:
            if op.kind == "input" or (op.kind in LINEAR_KINDS and op.inputs
                                      and all(i in static for i in op.inputs)):
                static.add(op.name)
        return static

    def terms(self, name: str) -> list[tuple[str, list[Any]]]:
        """The input of op ``name`` as a list of (source neuron, chain of linear ops)."""
        out: list[tuple[str, list[Any]]] = []
        for i in self.ops[name].inputs:
            op = self.ops[i]
            if op.kind in SPIKING:
                out.append((i, []))
            elif op.kind == "input" or i in self.static:
                out.append(("__static__", [op]))
            elif op.kind in LINEAR_KINDS:
                out.extend((s, chain + [op]) for s, chain in self.terms(i))
            else:
                raise BackendError(f"{self.backend}: op '{i}' ({op.kind}) cannot feed '{name}'")
        return out

    def const(self, name: str) -> torch.Tensor:
        """The input of op ``name`` when every neuron is silent and the static input is 0 (biases
        only; a static value reaching a later layer is a bias current per image), float64, batch 1."""
        total = None
        for i in self.ops[name].inputs:
            op = self.ops[i]
            if op.kind in SPIKING or i in self.static:
                v = torch.zeros(1, *op.out_shape, dtype=torch.float64)
            else:
                v = apply_op(op, self.const(i), bias=True).reshape(1, *op.out_shape)
            total = v if total is None else total + v
        assert total is not None, f"op '{name}' has no input"
        return total


def chain_kind(chain: list[Any], src_shape: tuple[int, ...], tgt_shape: tuple[int, ...]):
    """How a chain of linear ops runs: ("conv", conv op), ("diag", scale op or None) or ("matrix", None)."""
    core = [op for op in chain if op.kind != "sum"]
    if len(core) == 1 and core[0].kind in ("conv1d", "conv2d"):
        return "conv", core[0]
    if len(core) >= 2 and chain_as_conv(core) is not None:
        return "conv", core
    scales = [op for op in core if op.kind != "flatten"]
    if int(np.prod(src_shape)) == int(np.prod(tgt_shape)) and (
            not scales or (len(scales) == 1 and scales[0].kind == "scale")):
        return "diag", scales[0] if scales else None
    return "matrix", None


def pool_then_conv(pool: Any, conv: Any) -> tuple[np.ndarray, dict[str, Any]] | None:
    """Average pooling (kernel k, stride s, padding p, padding counted) then a stride-1
    convolution (kernel K), as one convolution of kernel ``s (K - 1) + k``, stride s:
    ``K'[.., s*a + i, s*b + j] += K[.., a, b] / k**2`` (exact: a linear map of a linear map).
    The convolution may pad (P) only where the pooling tiles its input (k = s, p = 0): then a
    padded pooled position maps wholly outside the input, and the padding is ``k P``. ``None``
    when the pair does not have this form."""
    if pool.kind != "avgpool2d" or pool.params.get("adaptive", False):
        return None
    k = tuple(int(v) for v in pool.params["kernel_size"])
    s = tuple(int(v) for v in pool.params["stride"])
    p = tuple(int(v) for v in pool.params["padding"])
    cp = conv_params(conv)
    if cp["stride"] != (1, 1) or cp["dilation"] != (1, 1):
        return None
    if any(cp["padding"]) and (s != k or any(p) or any(n % kk for n, kk in zip(pool.in_shape[-2:], k))):
        return None
    w = np.asarray(conv.params["weight"], np.float64)
    K = w.shape[2:]
    big = np.zeros(w.shape[:2] + (s[0] * (K[0] - 1) + k[0], s[1] * (K[1] - 1) + k[1]))
    for a in range(K[0]):
        for b in range(K[1]):
            big[:, :, s[0] * a:s[0] * a + k[0], s[1] * b:s[1] * b + k[1]] += w[:, :, a:a + 1, b:b + 1] / (k[0] * k[1])
    return big, {"ndim": 2, "stride": s, "padding": (s[0] * cp["padding"][0] + p[0], s[1] * cp["padding"][1] + p[1]),
                 "dilation": (1, 1), "groups": cp["groups"]}


def conv_then_conv(first: Any, second: Any) -> tuple[np.ndarray, dict[str, Any]] | None:
    """A 1x1 stride-1 convolution (no padding, one group) then any convolution of one group, as
    one convolution with the second's geometry: ``K[o, i] = sum_m K2[o, m] K1[m, i]`` (exact: a
    linear map of a linear map; MobileNetV2's linear bottleneck between two blocks). ``None``
    when the pair does not have this form."""
    if first.kind != "conv2d" or second.kind != "conv2d":
        return None
    c1, c2 = conv_params(first), conv_params(second)
    w1 = np.asarray(first.params["weight"], np.float64)
    if w1.shape[2:] != (1, 1) or c1["stride"] != (1, 1) or any(c1["padding"]) or c1["groups"] != 1 \
            or c2["groups"] != 1:
        return None
    w2 = np.asarray(second.params["weight"], np.float64)
    return np.einsum("omhw,mi->oihw", w2, w1[:, :, 0, 0]), dict(c2)


def pair_as_conv(first: Any, second: Any) -> tuple[np.ndarray, dict[str, Any]] | None:
    """Two linear ops as one convolution (:func:`pool_then_conv`, :func:`conv_then_conv`), or None."""
    return pool_then_conv(first, second) or conv_then_conv(first, second)


def _channel_scale(op: Any) -> np.ndarray | None:
    """A ``scale`` op's factor per channel ``[C]``, or None where it varies within a channel."""
    s = np.broadcast_to(np.asarray(op.params["scale"], np.float64), op.in_shape)
    per = s.reshape(s.shape[0], -1)
    return per[:, 0].copy() if np.all(per == per[:, :1]) else None


def chain_as_conv(core: list[Any]) -> tuple[np.ndarray, dict[str, Any]] | None:
    """A chain of linear ops as one convolution, or None: a pair of :func:`pair_as_conv` (after
    per-channel scales of the input, for a pooling then a convolution), or
    per-channel scales of the input (a source's output scale), a convolution, then 1x1 stride-1
    convolutions of one group (a concatenation's channel placement, a BatchNorm that reads a
    concatenation: DenseNet's) and per-channel scales, each a linear map of the input or output
    channels: ``K[o, i] = sum_m A[o, m] K[m, i] s[i]``, and after a 1x1 convolution an average
    pooling of kernel = stride (DenseNet's transition: a k x k convolution of stride k), exact."""
    if len(core) == 2 and core[1].kind == "conv2d":
        pair = pair_as_conv(core[0], core[1])
        if pair is not None:
            return pair
    if len(core) > 2 and core[-2].kind == "avgpool2d" and all(op.kind == "scale" for op in core[:-2]):
        # per-channel scales of the input (a source's output scale) commute with the pooling
        pair = pool_then_conv(core[-2], core[-1]) if core[-1].kind == "conv2d" else None
        if pair is None or pair[1]["groups"] != 1:
            return None
        w = pair[0]
        for op in core[:-2]:
            s = _channel_scale(op)
            if s is None or s.shape[0] != w.shape[1]:
                return None
            w = w * s.reshape(1, -1, 1, 1)
        return w, pair[1]
    first = next((i for i, op in enumerate(core) if op.kind != "scale"), len(core))
    if first == len(core) or core[first].kind != "conv2d":
        return None
    w, params = np.asarray(core[first].params["weight"], np.float64), dict(conv_params(core[first]))
    for op in core[:first]:  # per-channel scales of the input (a source's output scale)
        s = _channel_scale(op)
        if s is None or params["groups"] != 1 or s.shape[0] != w.shape[1]:
            return None
        w = w * s.reshape(1, -1, 1, 1)
    for op in core[first + 1:]:
        if op.kind == "avgpool2d":  # after a 1x1 convolution: a k x k convolution of stride k
            k = tuple(int(v) for v in op.params["kernel_size"])
            if (op.params.get("adaptive", False) or tuple(int(v) for v in op.params["stride"]) != k
                    or any(int(v) for v in op.params["padding"]) or w.shape[2:] != (1, 1)
                    or params["stride"] != (1, 1) or any(params["padding"]) or params["dilation"] != (1, 1)
                    or any(n % kk for n, kk in zip(op.in_shape[-2:], k))):
                return None
            w = np.repeat(np.repeat(w, k[0], axis=2), k[1], axis=3) / (k[0] * k[1])
            params = dict(params, stride=k)
            continue
        if op.kind == "scale":
            s = _channel_scale(op)
            if s is None or s.shape[0] != w.shape[0]:
                return None
            w = w * s.reshape(-1, 1, 1, 1)
            continue
        if op.kind != "conv2d" or params["groups"] != 1:
            return None
        c = conv_params(op)
        m = np.asarray(op.params["weight"], np.float64)
        if m.shape[2:] != (1, 1) or c["stride"] != (1, 1) or any(c["padding"]):
            return None
        if c["groups"] == m.shape[0] == w.shape[0] and m.shape[1] == 1:  # 1x1 depthwise: a scale
            w = w * m.reshape(-1, 1, 1, 1)
        elif c["groups"] == 1:
            w = np.einsum("om,mihw->oihw", m[:, :, 0, 0], w)
        else:
            return None
    return w, params


#: The most entries of a chain composed into a dense matrix (2**28: 2 GiB in float64).
MAX_COMPOSED = 2**28


def compose(chain: list[Any], src_shape: tuple[int, ...], n_tgt: int) -> np.ndarray:
    """The chain's linear map (biases left out) as a float64 matrix ``[N_target, N_source]``."""
    n_src = int(np.prod(src_shape))
    # 2 GiB of float64 at most: torchvision Inception v3's two poolings then a 1x1 convolution
    # (Mixed_5b's pool branch, the second pooling padded: no one convolution) at 75 px are
    # 3,136 x 43,200 = 1.35e8 entries
    if n_src * n_tgt > MAX_COMPOSED:
        raise BackendError(
            f"loihi2-sim: the op chain {[op.name for op in chain]} composes into a "
            f"{n_tgt} x {n_src} weight matrix, too large to build; put a convolution or a "
            "neuron layer between pooling and the next layer")
    mat = np.zeros((n_tgt, n_src))
    rows = max(1, min(1024, 2**24 // n_src))  # one-hot inputs of at most 128 MiB at a time
    for lo in range(0, n_src, rows):
        hi = min(n_src, lo + rows)
        x = torch.zeros(hi - lo, n_src, dtype=torch.float64)
        x[torch.arange(hi - lo), torch.arange(lo, hi)] = 1.0
        x = x.reshape(hi - lo, *src_shape)
        for op in chain:
            x = apply_op(op, x.reshape(hi - lo, *op.in_shape), bias=False)
        mat[:, lo:hi] = x.reshape(hi - lo, n_tgt).T.numpy()
    return mat


def fanout(kind: str, mant: np.ndarray, conv: Mapping[str, Any] | None, src_shape, tgt_shape) -> np.ndarray:
    """Synapses per source neuron ``[N_source]`` (float64); zero mantissas count as absent."""
    if kind == "conv":
        assert conv is not None, "a convolution connection without its parameters"
        ones = torch.ones(1, *tgt_shape, dtype=torch.float64)
        w = torch.as_tensor((mant != 0).astype(np.float64))
        fn = nn_grad.conv1d_input if conv["ndim"] == 1 else nn_grad.conv2d_input
        f = fn((1, *src_shape), w, ones, tuple(conv["stride"]), tuple(conv["padding"]),
               tuple(conv["dilation"]), int(conv["groups"]))
        return f.reshape(-1).numpy()
    if kind == "matrix":
        return (mant != 0).sum(0).astype(np.float64)
    if kind == "bias":
        return np.array([float((mant != 0).sum())])
    return (mant.reshape(-1) != 0).astype(np.float64)
