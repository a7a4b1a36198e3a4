"""Channel rearrangements (ShuffleNet's channel shuffle and chunk) as one-hot 1x1 convolutions,
and flattening by shape arithmetic as ``nn.Flatten``.

``view -> transpose -> contiguous -> view`` over the channels, ``chunk(k, dim=1)[i]`` and their
compositions move or select whole channels: ``out[c] = in[p[c]]`` at every position. Such a
chain, with the shape arithmetic it reads (``x.size()``, ``//``), becomes one ``Conv2d(C, C', 1)``
whose weight is the one-hot matrix of ``p``: exact (each output is one input times 1 plus
zeros), a layer every stage knows, and a form NIR has. The map ``p`` is read by running the
chain on a tensor of channel indices. A chain that flattens every dimension after the batch
(``x.view(x.size(0), -1)``, ``x.reshape(len(x), -1)``) becomes ``nn.Flatten()``, a layer NIR
has. In place on a traced graph; returns what changed.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.graph import capture, describe_node

__all__ = ["rewrite_channel_moves"]

#: Pattern as data: the operations a rearrangement chain may hold (tensor moves and the shape
#: arithmetic they read).
_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "chunk", "split", "size",
            "flatten", "unflatten"}
_FUNCTIONS = {operator.getitem, operator.floordiv, operator.mul, torch.transpose, torch.reshape,
              torch.permute, torch.chunk, torch.split, torch.flatten, getattr}


def _movable(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _METHODS) or (
        node.op == "call_function" and node.target in _FUNCTIONS)


def _chain(end: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The rearrangement nodes ``end`` depends on and the one tensor they start from."""
    members, sources, stack = set(), set(), [end]
    while stack:
        node = stack.pop()
        if node in members:
            continue
        if not _movable(node):
            sources.add(node)
            continue
        members.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in end.graph.nodes if n in members], (next(iter(sources)) if len(sources) == 1 else None)


def _chain_module(chain: list[fx.Node], src: fx.Node, end: fx.Node) -> fx.GraphModule:
    """The chain alone as a module of one input (``src``), returning ``end``."""
    graph = fx.Graph()
    env = {src: graph.placeholder("x")}
    for node in chain:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[end])
    return fx.GraphModule(nn.Module(), graph)


def _channel_map(chain: list[fx.Node], src: fx.Node, end: fx.Node, shape: tuple) -> list[int] | None:
    """``p`` with ``end[c] = src[p[c]]`` at every position, or None for another rearrangement."""
    C, *spatial = shape[1:]
    index = torch.arange(C, dtype=torch.float64).reshape(1, C, *([1] * len(spatial))).expand(1, C, *spatial)
    try:
        run = _chain_module(chain, src, end)
        out, shifted = run(index.contiguous()), run(index.contiguous() + 1000.0)
    except Exception:
        return None
    if not isinstance(shifted, torch.Tensor) or not torch.equal(shifted, out + 1000.0):
        return None  # the chain computes on the values: no rearrangement
    if not isinstance(out, torch.Tensor) or out.dim() != len(shape) or tuple(out.shape[2:]) != tuple(spatial):
        return None
    first = out[0].reshape(out.shape[1], -1)
    if not torch.equal(first, first[:, :1].expand_as(first)):
        return None  # not the same channel at every position
    perm = [int(c) for c in first[:, 0]]
    return perm if all(0 <= c < C and c == v for c, v in zip(perm, first[:, 0].tolist())) else None


def _flattens(chain: list[fx.Node], src: fx.Node, end: fx.Node, shape: tuple) -> bool:
    """Whether the chain computes ``src.flatten(1)`` (on two images of ``shape``'s sizes)."""
    probe = torch.arange(2 * math.prod(shape[1:]), dtype=torch.float64).reshape(2, *shape[1:])
    try:
        out = _chain_module(chain, src, end)(probe)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and torch.equal(out, probe.flatten(1))


def _replace(gm: fx.GraphModule, end: fx.Node, src: fx.Node, module: nn.Module, suffix: str, used: set) -> None:
    """``module`` applied to ``src`` in place of ``end`` for every reader outside the chain."""
    name, k = f"{end.name}_{suffix}", 1
    while name in used:
        name, k = f"{end.name}_{suffix}_{k}", k + 1
    used.add(name)
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(end):
        new = gm.graph.call_module(name, (src,))
    for user in [u for u in end.users if not _movable(u)]:
        user.replace_input_with(end, new)


def rewrite_channel_moves(gm: fx.GraphModule, example_inputs: Iterable) -> list[dict]:
    """Replace every chain of channel moves on a 4-d tensor by a one-hot 1x1 convolution, and
    every chain that flattens all but the batch dimension by ``nn.Flatten()``."""
    ends = [n for n in gm.graph.nodes if _movable(n) and any(not _movable(u) for u in n.users)]
    if not ends:
        return []
    values = capture(gm, example_inputs, [n.name for n in gm.graph.nodes],
                     reduce=lambda t: ("tensor", tuple(t.shape)))
    values = {k: v[1] for k, v in values.items() if isinstance(v, tuple) and v[:1] == ("tensor",)}
    done: list[dict[str, Any]] = []
    used = {n for n, _ in gm.named_modules()}
    for end in ends:
        chain, src = _chain(end)
        shape, out_shape = values.get(getattr(src, "name", None)), values.get(end.name)
        if src is None or not isinstance(shape, tuple) or not isinstance(out_shape, tuple):
            continue
        plain = len(chain) == 1 and chain[0].target in ("flatten", torch.flatten)  # NIR reads it as it is
        if len(shape) > 2 and out_shape == (shape[0], math.prod(shape[1:])) and not plain \
                and _flattens(chain, src, end, shape):
            _replace(gm, end, src, nn.Flatten(), "flatten", used)
            done.append({"site": describe_node(end), "from": src.name, "flatten": list(shape[1:])})
            continue
        if len(shape) != 4:
            continue
        perm = _channel_map(chain, src, end, shape)
        if perm is None:
            continue
        if perm == list(range(shape[1])):  # moves nothing (a contiguous(), a reshape to itself)
            for user in [u for u in end.users if not _movable(u)]:
                user.replace_input_with(end, src)
            done.append({"site": describe_node(end), "from": src.name, "channels": "identity"})
            continue
        conv = nn.Conv2d(shape[1], len(perm), 1, bias=False)
        weight = torch.zeros(len(perm), shape[1], 1, 1)
        weight[torch.arange(len(perm)), torch.tensor(perm)] = 1.0
        conv.weight = nn.Parameter(weight, requires_grad=True)
        _replace(gm, end, src, conv, "channels", used)
        done.append({"site": describe_node(end), "from": src.name, "channels": [shape[1], len(perm)]})
    if done:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done
