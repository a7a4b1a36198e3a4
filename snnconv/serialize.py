"""A GraphModule as plain data (no pickled code), for ``SpikingNetwork.save``/``load``.

Modules and functions come from fixed tables; anything else is refused on save and on load,
so loading a file never runs code from it.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .errors import CheckpointError, UnsupportedModelError

__all__ = ["graph_to_dict", "graph_from_dict"]


def _conv_cfg(m: nn.Module) -> dict:
    return dict(in_channels=m.in_channels, out_channels=m.out_channels, kernel_size=m.kernel_size,
                stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups,
                bias=m.bias is not None, padding_mode=m.padding_mode)


def _avgpool_cfg(m: nn.Module) -> dict:
    cfg = dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding,
               ceil_mode=m.ceil_mode, count_include_pad=m.count_include_pad)
    if hasattr(m, "divisor_override"):
        cfg["divisor_override"] = m.divisor_override
    return cfg


def _module_table() -> dict[str, tuple[type, Callable[[nn.Module], dict]]]:
    from .spiking import IFNeuron, Scale, TimeExpand

    table: dict[str, tuple[type, Callable[[nn.Module], dict]]] = {
        "Linear": (nn.Linear, lambda m: dict(in_features=m.in_features, out_features=m.out_features,
                                             bias=m.bias is not None)),
        "Flatten": (nn.Flatten, lambda m: dict(start_dim=m.start_dim, end_dim=m.end_dim)),
        "Identity": (nn.Identity, lambda m: {}),
        "IFNeuron": (IFNeuron, lambda m: dict(theta=torch.ones(m.theta.shape), T=m.T, alpha=m.alpha,
                                              detach_reset=m.detach_reset, reset=m.reset,
                                              v_init=torch.zeros(m.v_init.shape)
                                              if m.reset == "subtract" else None)),
        "Scale": (Scale, lambda m: dict(theta=torch.ones(m.theta.shape))),
        "TimeExpand": (TimeExpand, lambda m: dict(T=m.T)),
    }
    for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        table[cls.__name__] = (cls, _conv_cfg)
    for cls in (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d):
        table[cls.__name__] = (cls, _avgpool_cfg)
    for cls in (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d):
        table[cls.__name__] = (cls, lambda m: dict(output_size=m.output_size))
    for cls in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
        table[cls.__name__] = (cls, lambda m: dict(p=m.p))
    return table


_FUNCTIONS: dict[str, Callable] = {
    f"{mod}.{fn.__name__}": fn
    for mod, fns in {
        "operator": [operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                     operator.getitem, operator.iadd, operator.imul],
        "torch": [torch.add, torch.sub, torch.mul, torch.cat, torch.flatten, torch.mean,
                  torch.sum, torch.stack, torch.reshape, torch.squeeze, torch.unsqueeze],
        "torch.nn.functional": [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                                F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.pad, F.dropout,
                                F.linear, F.conv1d, F.conv2d, F.conv3d],
        "builtins": [getattr],
    }.items()
    for fn in fns
}
_FUNCTION_NAMES = {id(fn): name for name, fn in _FUNCTIONS.items()}
_METHODS = {"flatten", "view", "reshape", "size", "mean", "sum", "permute", "transpose",
            "contiguous", "add", "mul", "unsqueeze", "squeeze", "expand", "chunk", "split", "dim",
            "add_", "mul_", "float"}
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                torch.int64, torch.int32, torch.bool)}


def _enc(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, tuple):
        return {"tuple": [_enc(x) for x in a]}
    if isinstance(a, list):
        return {"list": [_enc(x) for x in a]}
    if isinstance(a, dict):
        return {"dict": {str(k): _enc(v) for k, v in a.items()}}
    if isinstance(a, slice):
        return {"slice": [_enc(a.start), _enc(a.stop), _enc(a.step)]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a)}
    if a is Ellipsis:
        return {"ellipsis": True}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise UnsupportedModelError(f"cannot save a graph argument of type {type(a).__name__} ({a!r})")


def _dec(a: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(a, dict):
        if "node" in a:
            return env[a["node"]]
        if "tuple" in a:
            return tuple(_dec(x, env) for x in a["tuple"])
        if "list" in a:
            return [_dec(x, env) for x in a["list"]]
        if "dict" in a:
            return {k: _dec(v, env) for k, v in a["dict"].items()}
        if "slice" in a:
            return slice(*(_dec(x, env) for x in a["slice"]))
        if "dtype" in a:
            if a["dtype"] not in _DTYPES:
                raise CheckpointError(f"unknown dtype {a['dtype']!r} in saved graph")
            return _DTYPES[a["dtype"]]
        if "ellipsis" in a:
            return Ellipsis
        raise CheckpointError(f"malformed graph argument {a!r}")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise CheckpointError(f"malformed graph argument of type {type(a).__name__}")


def graph_to_dict(gm: fx.GraphModule) -> dict:
    """Nodes (op, name, target, args, kwargs) and modules (type, constructor config) as plain data."""
    table = _module_table()
    by_type = {cls: name for name, (cls, _) in table.items()}
    modules = {}
    nodes = []
    for node in gm.graph.nodes:
        target: Any = node.target
        if node.op == "call_module":
            mod = gm.get_submodule(target)
            kind = by_type.get(type(mod))
            if kind is None:
                raise UnsupportedModelError(
                    f"cannot save module '{target}' of type {type(mod).__name__}: the spiking "
                    f"network format knows {sorted(table)}")
            modules[target] = {"type": kind, "config": table[kind][1](mod)}
        elif node.op == "call_function":
            target = _FUNCTION_NAMES.get(id(node.target))
            if target is None:
                raise UnsupportedModelError(f"cannot save function call {node.target} "
                                            f"(fx node '{node.name}')")
        elif node.op == "call_method" and target not in _METHODS:
            raise UnsupportedModelError(f"cannot save method call .{target}() (fx node '{node.name}')")
        elif node.op == "get_attr":
            raise UnsupportedModelError(f"cannot save attribute access '{target}' (fx node '{node.name}')")
        nodes.append({"op": node.op, "name": node.name, "target": target,
                      "args": _enc(node.args), "kwargs": _enc(node.kwargs)})
    return {"nodes": nodes, "modules": modules}


def graph_from_dict(data: dict) -> fx.GraphModule:
    """Rebuild a GraphModule from :func:`graph_to_dict` output (weights left at their init)."""
    table = _module_table()
    root = nn.Module()
    try:
        for target, spec in data["modules"].items():
            kind = spec["type"]
            if kind not in table:
                raise CheckpointError(f"unknown module type {kind!r} for '{target}'")
            owner = root
            *parents, leaf = target.split(".")
            for p in parents:
                if not hasattr(owner, p):
                    owner.add_module(p, nn.Module())
                owner = getattr(owner, p)
            owner.add_module(leaf, table[kind][0](**spec["config"]))
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        for rec in data["nodes"]:
            op, target = rec["op"], rec["target"]
            args, kwargs = _dec(rec["args"], env), _dec(rec["kwargs"], env)
            if op == "call_function":
                if target not in _FUNCTIONS:
                    raise CheckpointError(f"function {target!r} is not allowed in a saved graph")
                target = _FUNCTIONS[target]
            elif op == "call_method" and target not in _METHODS:
                raise CheckpointError(f"method {target!r} is not allowed in a saved graph")
            elif op not in ("placeholder", "call_module", "call_function", "call_method", "output"):
                raise CheckpointError(f"node kind {op!r} is not allowed in a saved graph")
            if op == "output":
                graph.output(args[0])
                continue
            node = graph.create_node(op, target, args, kwargs, name=rec["name"])
            env[rec["name"]] = node
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed saved graph: {type(exc).__name__}: {exc}") from exc
    graph.lint()
    return fx.GraphModule(root, graph, "SpikingGraph")
