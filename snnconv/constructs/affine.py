"""A BatchNorm that no convolution precedes, as the per-channel affine map it is at evaluation.

``bn(x) = s * x + t`` per channel, ``s = gamma / sqrt(var + eps)``, ``t = beta - s * mean``. Where
the BatchNorm's one user is a Conv/Linear without padding (so that every input position it reads
is a real one), the map folds into that layer's input side: ``W'[o, c] = s[c] W[o, c]``, ``b' = b
+ sum W[o, c] t[c]``. Elsewhere (after a concatenation, in a pre-activation block, on a neuron's
input side) it becomes an explicit depthwise 1x1 convolution (a diagonal Linear on a 2-d input)
with weight ``s`` and bias ``t``: a layer every stage and the NIR export already know, any sign of
``s`` included. Either way no BatchNorm remains. Zero padding makes the input-side fold inexact
at the borders (a padded zero would become ``t``), so a padded consumer gets the explicit layer.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from snnconv.graph import module_of, set_module

__all__ = ["channel_affine", "affine_layer", "fold_into_consumer", "replace_with_affine"]

_CONSUMERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

#: The depthwise layer of a BatchNorm's affine map, by the rank of its (batched) input.
_DEPTHWISE = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}
_RANK_OF = {nn.BatchNorm2d: 4, nn.BatchNorm3d: 5}


def channel_affine(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, t)`` in float64 with ``bn(x) = s * x + t`` per channel (running statistics)."""
    assert bn.running_mean is not None and bn.running_var is not None, "a BatchNorm without running statistics"
    mean, var = bn.running_mean.detach().double(), bn.running_var.detach().double()
    g = bn.weight.detach().double() if bn.affine else torch.ones_like(mean)
    b = bn.bias.detach().double() if bn.affine else torch.zeros_like(mean)
    s = g / torch.sqrt(var + bn.eps)
    return s, b - s * mean


def affine_layer(bn: _BatchNorm, rank: int | None) -> nn.Module:
    """The explicit per-channel affine layer computing ``bn`` on a ``rank``-d input (None:
    the rank the BatchNorm type implies; a BatchNorm1d is then taken to see ``[B, C]``)."""
    s, t = channel_affine(bn)
    assert bn.running_mean is not None
    dtype = bn.running_mean.dtype
    rank = rank if rank is not None else _RANK_OF.get(type(bn), 2)
    C = s.numel()
    layer: nn.Module
    if rank == 2:
        layer = nn.Linear(C, C)
        weight = torch.diag(s)
    else:
        layer = _DEPTHWISE[rank](C, C, 1, groups=C)
        weight = s.reshape(C, 1, *([1] * (rank - 2)))
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=True)
    layer.bias = nn.Parameter(t.to(dtype), requires_grad=True)
    return layer.to(bn.running_mean.device)


def _unpadded(layer: Any) -> bool:
    if isinstance(layer, nn.Linear):
        return True
    padding = layer.padding
    return padding == "valid" or (not isinstance(padding, str) and not any(padding))


def fold_into_consumer(gm: fx.GraphModule, bn_node: fx.Node, rank: int | None,
                       calls: dict[str, int]) -> str | None:
    """Fold ``bn_node``'s affine map into its only user where that is exact; the user's name,
    or None (nothing changed). ``calls``: call sites per module (a shared layer is not edited)."""
    users = list(bn_node.users)
    if len(users) != 1 or users[0].args[:1] != (bn_node,) or len(users[0].all_input_nodes) != 1:
        return None
    user = users[0]
    layer = module_of(gm, user)
    if not isinstance(layer, _CONSUMERS) or calls.get(str(user.target), 0) != 1 or not _unpadded(layer):
        return None
    bn = cast(_BatchNorm, module_of(gm, bn_node))
    s, t = channel_affine(bn)
    w = layer.weight.detach().double()
    C = s.numel()
    if isinstance(layer, nn.Linear):
        if rank != 2 or w.shape[1] != C:
            return None
        w_new, shift = w * s.unsqueeze(0), w @ t
    else:
        if layer.in_channels != C or rank != w.dim():
            return None
        in_pg, out_pg = C // layer.groups, layer.out_channels // layer.groups
        idx = (torch.arange(layer.out_channels) // out_pg).unsqueeze(1) * in_pg + torch.arange(in_pg)
        view = (layer.out_channels, in_pg) + (1,) * (w.dim() - 2)
        w_new = w * s[idx].reshape(view)
        shift = (w * t[idx].reshape(view)).flatten(1).sum(1)
    b = layer.bias.detach().double() if layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    new = copy.deepcopy(layer)
    new.weight = nn.Parameter(w_new.to(layer.weight.dtype), requires_grad=True)
    new.bias = nn.Parameter((b + shift).to(layer.weight.dtype), requires_grad=True)
    set_module(gm, str(user.target), new)
    return str(user.target)


def replace_with_affine(gm: fx.GraphModule, bn_node: fx.Node, rank: int | None) -> str:
    """Install the explicit affine layer in the BatchNorm's place (same module name)."""
    set_module(gm, str(bn_node.target), affine_layer(cast(_BatchNorm, module_of(gm, bn_node)), rank))
    return str(bn_node.target)
