"""A global mean over the spatial dimensions (``x.mean([2, 3])``) as the average pool it is, and
a functional pool (``F.adaptive_avg_pool2d(x, 1)``, ``F.avg_pool2d``, ``F.max_pool2d``) as its
module (what IF replacement, the max-pooling modes and NIR export know).

``mean(x, (2, 3))`` of a 4-d tensor is ``flatten(AdaptiveAvgPool2d(1)(x), 1)`` (without the
flatten for ``keepdim=True``): the same linear map, written with the layers that IF replacement
scales through and NIR export writes. The pass works on the traced graph in place (give it a
copy) and needs each site's input rank from an example batch.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.graph import capture, describe_node

__all__ = ["rewrite_means"]

#: Pattern as data: functional pools, their modules and the names of their arguments in order.
_POOL_CALLS = {
    F.adaptive_avg_pool1d: (nn.AdaptiveAvgPool1d, ("output_size",)),
    F.adaptive_avg_pool2d: (nn.AdaptiveAvgPool2d, ("output_size",)),
    F.adaptive_avg_pool3d: (nn.AdaptiveAvgPool3d, ("output_size",)),
    F.avg_pool2d: (nn.AvgPool2d, ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                                  "divisor_override")),
    F.max_pool2d: (nn.MaxPool2d, ("kernel_size", "stride", "padding", "dilation", "ceil_mode",
                                  "return_indices")),
}

#: Pattern as data: (op, target) of a mean, and the argument position of its dims.
_MEANS = {("call_function", torch.mean): 1, ("call_method", "mean"): 1}
_POOLS = {4: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool1d, 5: nn.AdaptiveAvgPool3d}


def _spatial_mean(node: fx.Node, rank: int) -> bool | None:
    """``keepdim`` of a mean over every dim after the channels of a ``rank``-d input, else None."""
    pos = _MEANS.get((node.op, node.target))
    if pos is None or rank not in _POOLS:
        return None
    dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    keep = node.args[pos + 1] if len(node.args) > pos + 1 else node.kwargs.get("keepdim", False)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if "dtype" in node.kwargs or not all(isinstance(d, int) for d in dims):
        return None
    if sorted(d % rank for d in dims) != list(range(2, rank)) or not isinstance(keep, bool):
        return None
    return keep


def _pool_modules(gm: fx.GraphModule) -> list[dict]:
    """Replace each functional pool of ``gm`` (adaptive average, average, max) by its module."""
    done = []
    used = {n for n, _ in gm.named_modules()}
    for node in list(gm.graph.nodes):
        cls, names = _POOL_CALLS.get(node.target, (None, ())) if node.op == "call_function" else (None, ())
        if cls is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        kwargs = dict(zip(names, node.args[1:]), **node.kwargs)
        if any(isinstance(v, fx.Node) for v in kwargs.values()) or set(kwargs) - set(names):
            continue
        name, k = f"{node.name}_pool", 1
        while name in used:
            name, k = f"{node.name}_pool_{k}", k + 1
        used.add(name)
        gm.add_submodule(name, cls(**kwargs))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(new)
        done.append({"site": describe_node(node), "pool": name})
        gm.graph.erase_node(node)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def rewrite_means(gm: fx.GraphModule, example_inputs: Iterable) -> list[dict]:
    """Replace every spatial mean of ``gm`` by adaptive average pooling (and a flatten), and
    every functional pool by its module."""
    done = _pool_modules(gm)
    candidates = [n for n in gm.graph.nodes if (n.op, n.target) in _MEANS
                  and n.args and isinstance(n.args[0], fx.Node)]
    if not candidates:
        return done
    ranks = capture(gm, example_inputs, [n.args[0].name for n in candidates],
                    reduce=lambda t: t.dim())
    used = {n for n, _ in gm.named_modules()}
    for node in candidates:
        rank = ranks.get(node.args[0].name)
        keep = _spatial_mean(node, rank) if isinstance(rank, int) else None
        if keep is None:
            continue
        names = []
        for base in ("pool", "flatten")[: 1 if keep else 2]:
            name, k = f"{node.name}_{base}", 1
            while name in used:
                name, k = f"{node.name}_{base}_{k}", k + 1
            used.add(name)
            names.append(name)
        gm.add_submodule(names[0], _POOLS[rank](1))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(names[0], (node.args[0],))
        if not keep:
            gm.add_submodule(names[1], nn.Flatten(1))
            with gm.graph.inserting_after(new):
                new = gm.graph.call_module(names[1], (new,))
        node.replace_all_uses_with(new)
        done.append({"site": describe_node(node), "pool": names[0]})
        gm.graph.erase_node(node)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
