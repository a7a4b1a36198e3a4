"""Time folded into the batch: where the static input meets the time steps. Layers that see only
the static input (before the first neuron) run once on ``[B, ...]``; :func:`insert_time_expand`
puts a :class:`~snnconv.snn.neuron.TimeExpand` where their output meets a layer that runs every
step. Used by the conversion (``to_spiking``) and by the NIR reader (``from_nir``). An
:class:`AnalogPrefix` holds the first layers of a network that run once per input, in analog,
before time begins (:mod:`snnconv.constructs.prefix` finds them)."""

from __future__ import annotations

import builtins

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.graph import module_of
from snnconv.snn.neuron import IFNeuron, LeakyNeuron, TimeExpand

__all__ = ["AnalogPrefix", "PREFIX_NAME", "analog_prefix", "insert_time_expand", "unique_name"]

#: The submodule name the prefix is installed under.
PREFIX_NAME = "analog_prefix"


def unique_name(base: str, used: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever is not yet a submodule name in ``used``."""
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name



_SHAPE_METHODS = {"size", "dim", "numel", "shape"}


def insert_time_expand(gm: fx.GraphModule, T: int, used: set[str]) -> list[str]:
    kind: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node.op == "placeholder":
            kind[node] = "static"
        elif node.op == "get_attr":
            kind[node] = "const"
        elif isinstance(module_of(gm, node), (IFNeuron, LeakyNeuron)) or any(kind.get(i) == "dynamic" for i in ins):
            kind[node] = "dynamic"
        elif (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
                node.op == "call_function" and node.target in (getattr, builtins.len)):
            kind[node] = "dynamic"
        elif any(kind.get(i) == "static" for i in ins):
            kind[node] = "static"
        else:
            kind[node] = "const"
    expanded: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if kind.get(node) not in ("dynamic",) and node.op != "output":
            continue
        for inp in node.all_input_nodes:
            if kind.get(inp) != "static":
                continue
            if inp not in expanded:
                name = unique_name(f"time_expand_{inp.name}", used)
                gm.add_submodule(name, TimeExpand(T))
                with gm.graph.inserting_after(inp):
                    expanded[inp] = gm.graph.call_module(name, (inp,))
            node.replace_input_with(inp, expanded[inp])
    return [n.name for n in expanded]


class AnalogPrefix(nn.Module):
    """Layers that see only the static input, run once per input in analog (``net``: a graph)."""

    def __init__(self, net: fx.GraphModule):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def analog_prefix(model: nn.Module) -> AnalogPrefix | None:
    """The :class:`AnalogPrefix` of a converted network (its graph's), else None."""
    net = getattr(model, "net", model)
    mod = getattr(net, PREFIX_NAME, None)
    return mod if isinstance(mod, AnalogPrefix) else None
