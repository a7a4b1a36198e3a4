"""The static analog prefix: the layers up to the first max-pooling that sees only the input.

With direct encoding the input is the same at every step, so every layer before the first neuron
that sees a time-varying input computes a constant. A stem such as torchvision ResNet's (7x7
conv, BatchNorm, ReLU, 3x3 max-pooling) therefore runs once, in analog, and its max-pooling and
ReLU are exact: the first IF layer comes after it and sees the stem's output at every step. The
pass moves those nodes into one :class:`AnalogPrefix` module called on the input, so that IF
replacement leaves them alone and NIR export can start the spiking graph at its output.

The prefix is the first max-pooling of the graph together with everything it depends on,
provided nothing else reads those nodes (one value crosses the cut) and it holds at most
:data:`MAX_PREFIX_SITES` ReLU sites. Later max-pooling is inside the spiking network, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.activation import relu_sites
from snnconv.graph import describe_node, module_of
from snnconv.snn.timing import PREFIX_NAME, AnalogPrefix, analog_prefix

__all__ = ["AnalogPrefix", "PREFIX_NAME", "split_prefix", "analog_prefix"]

#: The most ReLU sites a prefix holds: a stem (VGG-16's first block has two), not the network
#: (a max-pooling at the end of the features would otherwise leave nothing to spike).
MAX_PREFIX_SITES = 2

_MAX_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_MAX_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.max_pool1d, torch.max_pool2d,
                  torch.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d}


def _is_max(gm: fx.GraphModule, node: fx.Node) -> bool:
    return isinstance(module_of(gm, node), _MAX_MODULES) or (
        node.op == "call_function" and node.target in _MAX_FUNCTIONS)


def split_prefix(gm: fx.GraphModule) -> dict[str, Any]:
    """Move the static analog prefix of ``gm`` (in place) into an :class:`AnalogPrefix`.

    Returns what was done: ``{"nodes": [...], "ends_at": ...}``, or ``{"nodes": [], "why":
    ...}`` where ``gm`` has none (no max-pooling sees the input alone, or more than one value
    would cross the cut).
    """
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return {"nodes": [], "why": "the network takes more than one input"}
    static: set[fx.Node] = set(inputs) | {n for n in gm.graph.nodes if n.op == "get_attr"}
    cut = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.all_input_nodes and all(i in static for i in node.all_input_nodes):
            static.add(node)
            if _is_max(gm, node):
                cut = node
                break
    if cut is None:
        return {"nodes": [], "why": "no max-pooling sees the input alone"}
    members: set[fx.Node] = set()
    stack = [cut]
    while stack:
        node = stack.pop()
        if node in members or node.op == "placeholder":  # (get_attr nodes are copied along)
            continue
        members.add(node)
        stack.extend(node.all_input_nodes)
    sites = len(members & set(relu_sites(gm)))
    if sites > MAX_PREFIX_SITES:
        return {"nodes": [], "why": f"the first max-pooling ({describe_node(cut)}) comes after "
                                    f"{sites} ReLU sites: a network, not a stem"}
    leaks = [n for n in members if n is not cut and any(u not in members for u in n.users)]
    if leaks:
        return {"nodes": [], "why": f"{describe_node(leaks[0])} is also read after the max-pooling "
                                    f"at {describe_node(cut)}"}
    order = [n for n in gm.graph.nodes if n in members]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {inputs[0]: graph.placeholder(inputs[0].name)}
    for node in order:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[cut])
    prefix = AnalogPrefix(fx.GraphModule(gm, graph, "AnalogPrefix"))
    gm.add_submodule(PREFIX_NAME, prefix)
    with gm.graph.inserting_after(inputs[0]):
        call = gm.graph.call_module(PREFIX_NAME, (inputs[0],))
    cut.replace_all_uses_with(call)
    for node in reversed(order):
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return {"nodes": [describe_node(n) for n in order], "ends_at": describe_node(cut)}
