"""Pooling rewrites that are exact for the input size the network is converted at.

- :func:`fold_replicating_pools`: an adaptive average pool that only replicates a 1x1 map,
  folded into the Linear after it. VGG and AlexNet end their features with ``AdaptiveAvgPool2d((7, 7))`` / ``((6, 6))``; on inputs
small enough that the features are 1x1 (32 or 64 px) the pool copies each channel to every
position, and the flatten -> Linear that follows reads ``k * k`` copies: the same map as a Linear
on the channels whose weights are summed over the positions (``W'[o, c] = sum_p W[o, c k^2 + p]``).
  The pass makes that Linear (``k * k`` times smaller: VGG's 25,088-input layer becomes 512
  inputs) and drops the pool. Exact up to float rounding of the sum.
- :func:`drop_idle_ceil_mode`: ``ceil_mode=True`` on a pooling whose output size is the same
  without it (SqueezeNet's at 32 or 224 px) is turned off: the same function, and a form NIR has.

Both work in place on a traced graph and return what they changed.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.fx as fx
import torch.nn as nn

from .graph import call_counts, capture, describe_node, module_of

__all__ = ["fold_replicating_pools", "drop_idle_ceil_mode"]

#: Pattern as data: a flatten from dim 1, by (op, target).
_FLATTENS = {("call_function", torch.flatten), ("call_method", "flatten")}
#: Modules between the flatten and the Linear that change nothing at inference.
_PASS = (nn.Dropout, nn.Identity)


def _flatten_from_1(gm: fx.GraphModule, node: fx.Node) -> bool:
    mod = module_of(gm, node)
    if isinstance(mod, nn.Flatten):
        return mod.start_dim == 1 and mod.end_dim == -1
    if (node.op, node.target) in _FLATTENS:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    return False


def fold_replicating_pools(gm: fx.GraphModule, example_inputs: Iterable) -> list[dict]:
    """Fold every ``AdaptiveAvgPool2d`` of a 1x1 map -> flatten -> Linear into the Linear."""
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
        if before is None or len(before) != 4 or before[2:] != (1, 1) or len(pool.users) != 1:
            continue
        flat = next(iter(pool.users))
        if not _flatten_from_1(gm, flat) or len(flat.users) != 1:
            continue
        lin_node, prev = next(iter(flat.users)), flat
        while isinstance(module_of(gm, lin_node), _PASS) and len(lin_node.users) == 1:
            prev, lin_node = lin_node, next(iter(lin_node.users))  # AlexNet: dropout, then Linear
        linear = module_of(gm, lin_node)
        copies = after[2] * after[3]
        if (not isinstance(linear, nn.Linear) or calls.get(str(lin_node.target)) != 1
                or linear.in_features != before[1] * copies or lin_node.args[:1] != (prev,)):
            continue
        w = linear.weight.detach().double().reshape(linear.out_features, before[1], copies).sum(2)
        new = nn.Linear(before[1], linear.out_features, bias=linear.bias is not None)
        new.weight = nn.Parameter(w.to(linear.weight.dtype), requires_grad=True)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=True)
        gm.add_submodule(str(lin_node.target), new.to(linear.weight.device))
        pool.replace_all_uses_with(src)
        gm.graph.erase_node(pool)
        done.append({"pool": describe_node(pool), "linear": str(lin_node.target),
                     "in_features": [linear.in_features, before[1]]})
    if done:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done


_CEIL_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def drop_idle_ceil_mode(gm: fx.GraphModule, example_inputs: Iterable) -> list[str]:
    """Turn off ``ceil_mode`` on every pooling module where it does not change the output."""
    pools = [n for n in gm.graph.nodes
             if isinstance(module_of(gm, n), _CEIL_POOLS) and module_of(gm, n).ceil_mode]
    if not pools:
        return []
    shapes = capture(gm, example_inputs, [n.args[0].name for n in pools],
                     reduce=lambda t: tuple(t.shape))
    calls = call_counts(gm)
    done = []
    for node in pools:
        mod, shape = module_of(gm, node), shapes.get(node.args[0].name)
        if shape is None or calls.get(str(node.target)) != 1:
            continue
        floor = copy.deepcopy(mod)
        floor.ceil_mode = False
        probe = torch.zeros((1,) + tuple(shape[1:]))
        if floor(probe).shape == mod(probe).shape:
            mod.ceil_mode = False
            done.append(str(node.target))
    return done
