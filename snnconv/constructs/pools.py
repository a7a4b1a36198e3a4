"""Pooling rewrites that are exact for the input size the network is converted at.

Every pooling here is a fixed linear map between neurons; where NIR has no node for it, the map
is written with nodes it has, exactly:

- :func:`fold_adaptive_pools`: an ``AdaptiveAvgPool2d`` -> flatten -> Linear whose pool has no
  ``AvgPool2d`` form (uneven windows, such as VGG's ``(512, 2, 2) -> (512, 7, 7)`` at 64 px) or
  only replicates its input (``1x1 -> 7x7`` at 32 px), folded into the Linear. With ``A`` the
  pool's matrix (output position ``p`` from input position ``q``, computed by pooling the unit
  maps), ``W'[o, c, q] = sum_p W[o, c, p] A[p, q]`` in float64: a Linear on the pool's input,
  never larger than the one it replaces where the pool replicates (VGG's 25,088-input layer
  becomes 512 inputs at 32 px, 2,048 at 64 px). Exact up to float rounding of the sum.
- :func:`drop_idle_ceil_mode`: ``ceil_mode=True`` on a pooling whose output size is the same
  without it (SqueezeNet's at 32 or 224 px) is turned off: the same function, and a form NIR has.
- :func:`rewrite_ceil_pools`: an ``AvgPool2d`` whose ``ceil_mode`` adds a partial window at the
  right or bottom edge (SqueezeNet's 14 -> 7 at 64 px, once its max-pooling averages) becomes a
  depthwise ``Conv2d`` that sums each window (weights 1, with zero padding on both sides and
  zero taps where the left padding would be read) and a per-position :class:`Scale` by one over
  torch's divisor of that window. Both are NIR nodes (``Conv2d``, ``Scale``); the spiking
  network computes the same two ops as every backend, so their spikes are bit-identical.

All work in place on a traced graph and return what they changed.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, cast

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.graph import call_counts, capture, describe_node, module_of
from snnconv.snn.neuron import Scale

__all__ = ["fold_adaptive_pools", "drop_idle_ceil_mode", "rewrite_ceil_pools", "ceil_pool_parts"]

#: Pattern as data: a flatten from dim 1, by (op, target).
_FLATTENS = {("call_function", torch.flatten), ("call_method", "flatten")}
#: Modules between the flatten and the Linear that change nothing at inference.
_PASS = (nn.Dropout, nn.Identity)


def _flatten_from_1(gm: fx.GraphModule, node: fx.Node) -> bool:
    mod = module_of(gm, node)
    if isinstance(mod, nn.Flatten):
        return bool(mod.start_dim == 1 and mod.end_dim == -1)
    if (node.op, node.target) in _FLATTENS:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
    return False


def even_windows(in_hw: tuple[int, ...], out_hw: tuple[int, ...]) -> bool:
    """Whether an adaptive average pool from ``in_hw`` to ``out_hw`` is an ``AvgPool2d``
    (each output size divides its input size)."""
    return all(o and i % o == 0 for i, o in zip(in_hw, out_hw))


def adaptive_matrix(pool: nn.Module, in_hw: tuple[int, int]) -> torch.Tensor:
    """``A[p, q]``: output position ``p`` of ``pool`` as a combination of input position ``q``
    (float64, from pooling each unit map)."""
    n = in_hw[0] * in_hw[1]
    units = torch.eye(n, dtype=torch.float64).reshape(n, 1, *in_hw)
    with torch.no_grad():
        out = pool(units)  # [q, 1, H', W']
    return out.reshape(n, -1).T.contiguous()


def _folds(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Fold where the pool has no AvgPool2d form, or where it replicates (the Linear shrinks)."""
    return not even_windows(before[2:], after[2:]) or before[2] * before[3] <= after[2] * after[3]


def fold_adaptive_pools(gm: fx.GraphModule, example_inputs: Iterable) -> list[dict]:
    """Fold every ``AdaptiveAvgPool2d`` -> flatten -> Linear whose pool replicates or has uneven
    windows into the Linear (see the module docstring); return what was folded."""
    pools = [n for n in gm.graph.nodes if isinstance(module_of(gm, n), nn.AdaptiveAvgPool2d)]
    if not pools:
        return []
    shapes = capture(gm, example_inputs, [n.args[0].name for n in pools] + [n.name for n in pools],
                     reduce=lambda t: tuple(t.shape))
    calls = call_counts(gm)
    done = []
    for pool in pools:
        src = pool.args[0]
        before, after = shapes.get(src.name), shapes.get(pool.name)
        if (before is None or after is None or len(before) != 4 or len(pool.users) != 1
                or not _folds(before, after)):
            continue
        flat = next(iter(pool.users))
        if not _flatten_from_1(gm, flat) or len(flat.users) != 1:
            continue
        lin_node, prev = next(iter(flat.users)), flat
        while isinstance(module_of(gm, lin_node), _PASS) and len(lin_node.users) == 1:
            prev, lin_node = lin_node, next(iter(lin_node.users))  # AlexNet: dropout, then Linear
        linear = module_of(gm, lin_node)
        positions = after[2] * after[3]
        if (not isinstance(linear, nn.Linear) or calls.get(str(lin_node.target)) != 1
                or linear.in_features != before[1] * positions or lin_node.args[:1] != (prev,)):
            continue
        a = adaptive_matrix(cast(nn.Module, module_of(gm, pool)), tuple(before[2:]))  # [positions, h * w]
        w = linear.weight.detach().double().reshape(linear.out_features, before[1], positions)
        w = (w @ a).reshape(linear.out_features, -1)
        new = nn.Linear(w.shape[1], linear.out_features, bias=linear.bias is not None)
        new.weight = nn.Parameter(w.to(linear.weight.dtype), requires_grad=True)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=True)
        gm.add_submodule(str(lin_node.target), new.to(linear.weight.device))
        pool.replace_all_uses_with(src)
        gm.graph.erase_node(pool)
        done.append({"pool": describe_node(pool), "linear": str(lin_node.target),
                     "map": [list(before[1:]), list(after[1:])],
                     "in_features": [linear.in_features, w.shape[1]]})
    if done:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done


_CEIL_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def _ceil_pools(gm: fx.GraphModule, example_inputs: Iterable, kind) -> list[tuple[fx.Node, Any, tuple]]:
    """``(node, module, input shape)`` of each pooling module of ``kind`` with ``ceil_mode``
    that is called once and whose input the example reaches."""
    pools = [n for n in gm.graph.nodes if kind(m := module_of(gm, n)) and getattr(m, "ceil_mode", False)]
    if not pools:
        return []
    shapes = capture(gm, example_inputs, [n.args[0].name for n in pools], reduce=lambda t: tuple(t.shape))
    calls = call_counts(gm)
    return [(n, module_of(gm, n), shapes[n.args[0].name]) for n in pools
            if shapes.get(n.args[0].name) is not None and calls.get(str(n.target)) == 1]


def drop_idle_ceil_mode(gm: fx.GraphModule, example_inputs: Iterable) -> list[str]:
    """Turn off ``ceil_mode`` on every pooling module where it does not change the output."""
    done = []
    for node, mod, shape in _ceil_pools(gm, example_inputs, lambda m: isinstance(m, _CEIL_POOLS)):
        floor = copy.deepcopy(mod)
        floor.ceil_mode = False
        probe = torch.zeros((1,) + tuple(shape[1:]))
        if floor(probe).shape == mod(probe).shape:
            mod.ceil_mode = False
            done.append(str(node.target))
    return done


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else cast(tuple[int, int], tuple(int(x) for x in v))


def _axis(size: int, k: int, s: int, p: int, out: int, include_pad: bool) -> tuple[int, np.ndarray, int]:
    """One axis of a ceil-mode average pool: the sum's symmetric padding, each window's divisor
    (torch's: ``min(start + k, size + p) - start`` with the padding counted, the inputs inside
    the map without) and the zero taps before the window (where only the left padding is read)."""
    right = (out - 1) * s + k - size - p  # how far the last window reaches past the map
    pad = max(p, right)
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    if not include_pad:
        start, end = np.maximum(start, 0), np.minimum(end, size)
    return pad, (end - start).astype(np.float64), pad - p


def ceil_pool_parts(pool: nn.AvgPool2d, in_shape: tuple[int, int, int]) -> tuple[nn.Conv2d, Scale]:
    """The depthwise sum ``Conv2d`` and the per-position :class:`Scale` that compute ``pool``
    (``ceil_mode=True``) on a batch-free ``(C, H, W)`` input."""
    c, h, w = in_shape
    k, s, p = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size), _pair(pool.padding)
    with torch.no_grad():
        out = pool(torch.zeros(1, 1, h, w)).shape[2:]
    axes = [_axis(n, k[i], s[i], p[i], out[i], pool.count_include_pad) for i, n in enumerate((h, w))]
    conv = nn.Conv2d(c, c, (k[0] + axes[0][2], k[1] + axes[1][2]), stride=s, padding=(axes[0][0], axes[1][0]),
                     groups=c, bias=False)
    weight = torch.zeros_like(conv.weight)
    weight[:, :, axes[0][2]:, axes[1][2]:] = 1.0
    conv.weight = nn.Parameter(weight, requires_grad=False)
    divisor = np.outer(axes[0][1], axes[1][1])
    if getattr(pool, "divisor_override", None):
        divisor = np.full_like(divisor, float(pool.divisor_override))  # type: ignore[arg-type]  # set: checked above
    scale = Scale(torch.from_numpy(1.0 / divisor).to(torch.float32).unsqueeze(0))  # [1, H', W']
    return conv, scale


def rewrite_ceil_pools(gm: fx.GraphModule, example_inputs: Iterable) -> list[dict]:
    """Write every ``AvgPool2d`` whose ``ceil_mode`` adds a partial window as a depthwise sum
    ``Conv2d`` and a per-position ``Scale`` (see the module docstring); return what changed.
    Checked on the example input (float64, relative 1e-6); a pool that fails stays."""
    done = []
    for node, mod, shape in _ceil_pools(gm, example_inputs, lambda m: type(m) is nn.AvgPool2d):
        if len(shape) != 4:
            continue
        conv, scale = ceil_pool_parts(mod, tuple(shape[1:]))
        probe = torch.rand((2,) + tuple(shape[1:]), dtype=torch.float64)
        with torch.no_grad():
            ref = mod(probe)
            got = scale.double()(conv.double()(probe))
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-6, atol=1e-9):
            continue
        device = next((t.device for t in gm.parameters()), torch.device("cpu"))
        target = str(node.target)
        gm.add_submodule(target, conv.float().to(device))
        gm.add_submodule(f"{target}_divisor", scale.float().to(device))
        with gm.graph.inserting_after(node):
            div = gm.graph.call_module(f"{target}_divisor", (node,))
        node.replace_all_uses_with(div)
        div.args = (node,)
        done.append({"pool": describe_node(node), "conv": target, "scale": f"{target}_divisor",
                     "kernel": list(conv.kernel_size), "padding": list(conv.padding)})
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
