"""A network's torch.fx graph as plain data: the one schema that every network file is written
and read with (:class:`snnconv.snn.network.SpikingNetwork`, its analog prefix, the prefix file).

torch.fx turns a graph into Python source (``def forward(self, x): ...``) and runs it. A file's
graph therefore never reaches torch.fx as it was read: :func:`check_graph` first validates it
field by field against allow-lists, and only what passes is rebuilt:

- node kinds: ``placeholder`` (exactly one, first), ``call_module``, ``call_function``,
  ``call_method``, ``output`` (exactly one, last);
- node names and the placeholder's target: Python identifiers (no keyword, no ``__`` prefix),
  each node name once;
- ``call_module`` targets: a module the file itself declares, named by dotted parts that are
  letters, digits, underscores and hyphens (``layer1.0.conv1``), none shadowing an ``nn.Module`` attribute;
- ``call_function`` targets: names in :data:`FUNCTIONS`; ``call_method`` targets: names in
  :data:`METHODS`; ``getattr`` only of :data:`ATTRIBUTES`;
- arguments: references to earlier nodes, or constants of the types ``None``, bool, int, float,
  str, tuple, list, slice, Ellipsis and the dtypes of :data:`DTYPES`, nested at most
  :data:`MAX_DEPTH` deep; keyword names from :data:`KEYWORDS`;
- modules: a type of the module table, constructor keywords that the type's constructor takes,
  an analog prefix's graph nested at most once.

The writer (:func:`graph_to_dict`) checks its own output with the same function, so a network
that saves is one that loads. Strings from a file reach the generated code only as ``repr``
constants; names only after they matched the patterns above.
"""

from __future__ import annotations

import inspect
import keyword
import math
import operator
import re
from typing import Any, Callable, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.errors import CheckpointError, UnsupportedModelError
from snnconv.kinds import SAVED

__all__ = ["FUNCTIONS", "METHODS", "KEYWORDS", "ATTRIBUTES", "DTYPES", "MAX_NODES", "MAX_DEPTH",
           "check_graph", "graph_to_dict", "graph_from_dict"]

#: The functions a saved graph may call, by name: the allow-list of the format.
_FUNCTIONS_BY_MODULE: dict[str, list[Any]] = {
        "operator": [operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                     operator.getitem, operator.iadd, operator.imul],
        "torch": [torch.add, torch.sub, torch.mul, torch.cat, torch.flatten, torch.mean,
                  torch.sum, torch.stack, torch.reshape, torch.squeeze, torch.unsqueeze, torch.relu],
        "torch.nn.functional": [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                                F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.pad, F.dropout,
                                F.linear, F.conv1d, F.conv2d, F.conv3d,
                                # what an analog prefix (snnconv.constructs.prefix) runs once on the static input
                                F.relu, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d,
                                F.adaptive_max_pool2d, F.adaptive_max_pool3d],
        "builtins": [getattr],
}
FUNCTIONS: dict[str, Callable] = {f"{mod}.{fn.__name__}": fn for mod, fns in _FUNCTIONS_BY_MODULE.items() for fn in fns}
_FUNCTION_NAMES = {id(fn): name for name, fn in FUNCTIONS.items()}
#: The tensor methods a saved graph may call.
METHODS = frozenset({"flatten", "view", "reshape", "size", "mean", "sum", "permute", "transpose",
                     "contiguous", "add", "mul", "unsqueeze", "squeeze", "expand", "chunk", "split",
                     "dim", "add_", "mul_", "float", "relu", "relu_"})
#: The keyword names a call in a saved graph may pass (those of the functions and methods above).
KEYWORDS = frozenset({"dim", "start_dim", "end_dim", "keepdim", "dtype", "inplace", "alpha", "other",
                      "input", "tensors", "shape", "training", "p", "kernel_size", "stride", "padding",
                      "dilation", "groups", "ceil_mode", "count_include_pad", "divisor_override",
                      "output_size", "return_indices", "pad", "mode", "value", "weight", "bias",
                      "split_size_or_sections", "chunks", "size", "sizes", "dims", "dim0", "dim1"})
#: The attributes ``getattr`` may read in a saved graph.
ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "device"})
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                              torch.int64, torch.int32, torch.bool)}
#: Nodes and modules of one saved graph; a torchvision DenseNet-201 has about 1,500 nodes.
MAX_NODES = 100_000
#: Nesting of one argument (tuples in lists in ...).
MAX_DEPTH = 16
_OPS = ("placeholder", "call_module", "call_function", "call_method", "output")
_NODE_KEYS = {"op", "name", "target", "args", "kwargs"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: A part of a module path: torch.fx quotes one that is no identifier (getattr(m, "block1-0"),
#: torchvision's RegNets); no quote, backslash or dot can reach that string.
_PART = re.compile(r"[A-Za-z0-9_-]+\Z")
_MAX_STR = 1024

#: a module holding a graph of its own (the analog prefix), saved as a nested graph
_NESTED = "AnalogPrefix"


def _prefix_type() -> type:
    from snnconv.snn.timing import AnalogPrefix  # imported here: timing imports the neurons, as this does

    return AnalogPrefix


# --- the module table --------------------------------------------------------------------------

_TABLE = SAVED  # the module table: snnconv.kinds
#: each module type's constructor keywords (what a saved config may name)
_PARAMETERS = {kind: frozenset(p for p in inspect.signature(cls.__init__).parameters  # type: ignore[misc]
                               if p != "self")
               for kind, (cls, _) in _TABLE.items()}


# --- the schema --------------------------------------------------------------------------------

class _Refusal(Exception):
    """A field of a graph description that the schema refuses (turned into the caller's error)."""


def _identifier(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _IDENT.match(value) or keyword.iskeyword(value) \
            or value.startswith("__"):
        raise _Refusal(f"{what} {value!r:.80} is not a plain Python identifier")
    return value


def _module_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_STR:
        raise _Refusal(f"{what} {value!r:.80} is not a module name")
    for part in value.split("."):
        if not _PART.match(part) or keyword.iskeyword(part) or part.startswith("__") \
                or hasattr(nn.Module, part):
            raise _Refusal(f"{what} {value!r:.80}: its part {part!r:.40} is not made of letters, digits, "
                           "underscores and hyphens "
                           "(or names an attribute every module has)")
    return value


def _constant(a: Any, defined: set[str], depth: int = 0) -> list[str]:
    """Check one encoded argument; return the node names it references."""
    if depth > MAX_DEPTH:
        raise _Refusal(f"an argument is nested more than {MAX_DEPTH} deep")
    if a is None or isinstance(a, (bool, int, float)):
        return []
    if isinstance(a, str):
        if len(a) > _MAX_STR:
            raise _Refusal(f"a string argument of {len(a)} characters (at most {_MAX_STR})")
        return []
    if not isinstance(a, dict) or len(a) != 1:
        raise _Refusal(f"malformed graph argument of type {type(a).__name__}")
    (kind, value), = a.items()
    if kind == "node":
        if not isinstance(value, str) or value not in defined:
            raise _Refusal(f"an argument refers to {value!r:.80}, which is not an earlier node")
        return [value]
    if kind in ("tuple", "list", "slice"):
        if not isinstance(value, list) or (kind == "slice" and len(value) != 3):
            raise _Refusal(f"malformed {kind} argument")
        return [r for v in value for r in _constant(v, defined, depth + 1)]
    if kind == "dict":
        if not isinstance(value, dict):
            raise _Refusal("malformed dict argument")
        for k in value:
            _identifier(k, "a dict argument's key")
        return [r for v in value.values() for r in _constant(v, defined, depth + 1)]
    if kind == "dtype":
        if value not in DTYPES:
            raise _Refusal(f"unknown dtype {value!r:.80}")
        return []
    if kind == "ellipsis" and value is True:
        return []
    raise _Refusal(f"malformed graph argument {{{kind!r:.40}: ...}}")


def _config_value(value: Any, what: str, depth: int = 0) -> None:
    """A constructor argument as saved: a constant, a tuple or list of them, or a dense tensor."""
    if depth > MAX_DEPTH:
        raise _Refusal(f"{what} is nested more than {MAX_DEPTH} deep")
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.dtype not in DTYPES.values():
            raise _Refusal(f"{what} is a {value.layout} {value.dtype} tensor; the format stores dense ones")
    elif isinstance(value, (tuple, list)):
        for v in value:
            _config_value(v, what, depth + 1)
    elif isinstance(value, str):
        if len(value) > _MAX_STR:
            raise _Refusal(f"{what} is a string of {len(value)} characters (at most {_MAX_STR})")
    elif not (value is None or isinstance(value, (bool, int, float))):
        raise _Refusal(f"{what} is of type {type(value).__name__}, not a constant the format stores")


#: Ranges of the module constructors' integer arguments (kernel sizes, strides, paddings and
#: pooling outputs a network of up to 4096 px can use; sizes of layers far above any network's).
_INT_RANGES = {**{k: (0, 4096) for k in ("kernel_size", "stride", "padding", "dilation", "output_size",
                                          "output_padding")},
               **{k: (1, 2**24) for k in ("in_channels", "out_channels", "in_features", "out_features",
                                            "groups", "divisor_override")},
               "start_dim": (-8, 8), "end_dim": (-8, 8), "dim": (-8, 8), "unflattened_size": (1, 2**24),
               "T": (1, 2**20), "burst": (1, 255)}
#: The most integers an argument of ``_INT_RANGES`` holds (default 3: one per spatial dim):
#: a padding module's two sides per dim, an unflattened shape.
_INT_LENGTHS = {"padding": 6, "unflattened_size": 8}
_BOOLS = {"bias", "ceil_mode", "count_include_pad", "detach_reset", "inplace", "return_indices"}
_CHOICES = {"padding_mode": ("zeros", "reflect", "replicate", "circular"), "reset": ("subtract", "zero")}


def _config_argument(key: str, value: Any, what: str) -> None:
    """A constructor argument of the module table within its type and range (what torch would
    otherwise accept here and fail on, or allocate for, at the first forward)."""
    if key in _INT_RANGES:
        if key == "padding" and value in ("same", "valid"):
            return
        low, high = _INT_RANGES[key]
        items = value if isinstance(value, (tuple, list)) else (value,)
        if key == "output_size":
            items = [v for v in items if v is not None]
        if key == "divisor_override" and value is None:
            return
        most = _INT_LENGTHS.get(key, 3)
        if not items or len(items) > most or not all(
                isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in items):
            raise _Refusal(f"{what} is {value!r:.60}, not an integer (or up to {most}) in [{low}, {high}]")
    elif key in _BOOLS:
        if not isinstance(value, bool):
            raise _Refusal(f"{what} is {value!r:.60}, not True or False")
    elif key in _CHOICES:
        if value not in _CHOICES[key]:
            raise _Refusal(f"{what} is {value!r:.60}, not one of {_CHOICES[key]}")
    elif key in ("p", "alpha"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not (0 <= value <= (1 if key == "p" else 1e3)):
            raise _Refusal(f"{what} is {value!r:.60}, out of range")
    elif key in ("theta", "v_init"):
        if not (isinstance(value, torch.Tensor) or (key == "v_init" and value is None)):
            raise _Refusal(f"{what} is {type(value).__name__}, not a tensor")


def _check_node(rec: Any, modules: dict, defined: set[str]) -> None:
    if not isinstance(rec, dict) or set(rec) != _NODE_KEYS:
        raise _Refusal(f"a node is not a record of {sorted(_NODE_KEYS)}")
    op, name, target = rec["op"], rec["name"], rec["target"]
    if op not in _OPS:
        raise _Refusal(f"node kind {op!r:.80} is not allowed in a saved graph")
    _identifier(name, "node name")
    if name in defined:
        raise _Refusal(f"node name {name!r} appears twice")
    args, kwargs = rec["args"], rec["kwargs"]
    if not (isinstance(args, dict) and set(args) == {"tuple"} and isinstance(args["tuple"], list)):
        raise _Refusal(f"node '{name}': its arguments are not a tuple")
    if not (isinstance(kwargs, dict) and set(kwargs) == {"dict"} and isinstance(kwargs["dict"], dict)):
        raise _Refusal(f"node '{name}': its keyword arguments are not a dict")
    for key in kwargs["dict"]:
        if key not in KEYWORDS:
            raise _Refusal(f"node '{name}': keyword {key!r:.80} is not one the format allows")
    _constant(args, defined)
    _constant(kwargs, defined)
    if op == "placeholder":
        _identifier(target, f"node '{name}': the input's name")
        if args["tuple"] or kwargs["dict"]:
            raise _Refusal(f"the input '{name}' has a default value")
    elif op == "call_module":
        if not isinstance(target, str) or target not in modules:
            raise _Refusal(f"node '{name}' calls module {target!r:.80}, which the file does not declare")
    elif op == "call_function":
        if target not in FUNCTIONS:
            raise _Refusal(f"function {target!r:.80} is not allowed in a saved graph")
        if target == "builtins.getattr" and (len(args["tuple"]) != 2 or args["tuple"][1] not in ATTRIBUTES):
            raise _Refusal(f"node '{name}': getattr of anything but {sorted(ATTRIBUTES)}")
    elif op == "call_method":
        if target not in METHODS:
            raise _Refusal(f"method {target!r:.80} is not allowed in a saved graph")
    elif op == "output" and (len(args["tuple"]) != 1 or kwargs["dict"]):
        raise _Refusal("the output node takes exactly one value")


def _check_module(target: Any, spec: Any, depth: int) -> None:
    _module_path(target, "module name")
    if not isinstance(spec, dict):
        raise _Refusal(f"module '{target}' is not described by a record")
    kind = spec.get("type")
    if kind == _NESTED:
        if depth > 0 or set(spec) != {"type", "graph"}:
            raise _Refusal(f"module '{target}': an analog prefix is nested only once, as "
                           "{'type', 'graph'}")
        _check(spec["graph"], depth + 1)
        return
    if kind not in _TABLE:
        raise _Refusal(f"unknown module type {kind!r:.80} for '{target}'")
    config = spec.get("config")
    if set(spec) != {"type", "config"} or not isinstance(config, dict):
        raise _Refusal(f"module '{target}' ({kind}) is not described as {{'type', 'config'}}")
    for key, value in config.items():
        if key not in _PARAMETERS[kind]:
            raise _Refusal(f"module '{target}' ({kind}): {key!r:.80} is not an argument of {kind}")
        _config_value(value, f"module '{target}' ({kind}): {key}")
        _config_argument(key, value, f"module '{target}' ({kind}): {key}")


def _check(data: Any, depth: int = 0) -> None:
    if not isinstance(data, dict) or set(data) != {"nodes", "modules"}:
        raise _Refusal("the graph is not a record of 'nodes' and 'modules'")
    nodes, modules = data["nodes"], data["modules"]
    if not isinstance(nodes, list) or not isinstance(modules, dict):
        raise _Refusal("the graph's nodes are not a list or its modules not a dict")
    if len(nodes) > MAX_NODES or len(modules) > MAX_NODES:
        raise _Refusal(f"{len(nodes)} nodes and {len(modules)} modules (at most {MAX_NODES} each)")
    for target, spec in modules.items():
        _check_module(target, spec, depth)
    ops = [rec.get("op") if isinstance(rec, dict) else None for rec in nodes]
    if ops.count("placeholder") != 1 or ops[0] != "placeholder":
        raise _Refusal(f"the graph has {ops.count('placeholder')} inputs; a network has one, first")
    if ops.count("output") != 1 or ops[-1] != "output":
        raise _Refusal(f"the graph has {ops.count('output')} outputs; a network has one, last")
    defined: set[str] = set()
    for rec in nodes:
        _check_node(rec, modules, defined)
        defined.add(rec["name"])


def check_graph(data: Any, error: type[Exception] = CheckpointError) -> None:
    """Validate a graph description (:func:`graph_to_dict`'s output) against the format's schema.

    Raises:
        error (CheckpointError by default): the first field that the schema refuses, named.
    """
    try:
        _check(data)
    except _Refusal as exc:
        raise error(f"the saved graph is refused: {exc}") from None


# --- writing and reading -----------------------------------------------------------------------

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
    """An argument that :func:`check_graph` accepted, with node references resolved."""
    if not isinstance(a, dict):
        return a
    (kind, value), = a.items()
    if kind == "node":
        return env[value]
    if kind == "tuple":
        return tuple(_dec(x, env) for x in value)
    if kind == "list":
        return [_dec(x, env) for x in value]
    if kind == "dict":
        return {k: _dec(v, env) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_dec(x, env) for x in value))
    if kind == "dtype":
        return DTYPES[value]
    return Ellipsis


def graph_to_dict(gm: fx.GraphModule) -> dict:
    """Nodes (op, name, target, args, kwargs) and modules (type, constructor config) as plain data.

    Raises:
        UnsupportedModelError: a module, function, method or value the format cannot hold, or a
            graph that :func:`check_graph` would refuse on reading.
    """
    by_type = {cls: name for name, (cls, _) in _TABLE.items()}
    modules = {}
    nodes = []
    for node in gm.graph.nodes:
        target: Any = node.target
        if node.op == "call_module":
            mod = gm.get_submodule(target)
            kind = by_type.get(type(mod))
            if isinstance(mod, _prefix_type()):
                modules[target] = {"type": _NESTED, "graph": graph_to_dict(cast(fx.GraphModule, mod.net))}
            elif kind is None:
                raise UnsupportedModelError(
                    f"cannot save module '{target}' of type {type(mod).__name__}: the spiking "
                    f"network format knows {sorted(_TABLE)}")
            else:
                modules[target] = {"type": kind, "config": _TABLE[kind][1](mod)}
        elif node.op == "call_function":
            target = _FUNCTION_NAMES.get(id(node.target))
            if target is None:
                raise UnsupportedModelError(f"cannot save function call {node.target} "
                                            f"(fx node '{node.name}')")
        elif node.op == "call_method" and target not in METHODS:
            raise UnsupportedModelError(f"cannot save method call .{target}() (fx node '{node.name}')")
        elif node.op == "get_attr":
            raise UnsupportedModelError(f"cannot save attribute access '{target}' (fx node '{node.name}')")
        nodes.append({"op": node.op, "name": node.name, "target": target,
                      "args": _enc(node.args), "kwargs": _enc(node.kwargs)})
    data = {"nodes": nodes, "modules": modules}
    check_graph(data, UnsupportedModelError)
    return data


def _declared(cls: type, config: dict) -> nn.Module:
    """The module of ``config``; built on the meta device (nothing allocated) unless its config
    holds tensors (IFNeuron, Scale: their sizes are those of tensors stored in the file)."""
    if any(isinstance(v, torch.Tensor) for v in config.values()):
        return cls(**config)
    with torch.device("meta"):
        return cls(**config)


def _check_against(target: str, mod: nn.Module, state: dict) -> None:
    """Each parameter and buffer ``mod`` declares is stored in ``state`` with its shape and dtype."""
    prefix = target + "."
    for name, want in mod.state_dict().items():
        got = state.get(prefix + name)
        if got is None:
            raise CheckpointError(f"module '{target}' ({type(mod).__name__}) declares '{name}' of "
                                  f"shape {tuple(want.shape)}, which the file does not store")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(f"module '{target}' ({type(mod).__name__}): its config declares "
                                  f"'{name}' of shape {tuple(want.shape)} ({want.dtype}), the file "
                                  f"stores {tuple(got.shape)} ({got.dtype}); nothing was allocated")


def _install(root: nn.Module, target: str, mod: nn.Module) -> None:
    owner = root
    *parents, leaf = target.split(".")
    for p in parents:
        children = dict(owner.named_children())
        if p not in children:
            owner.add_module(p, nn.Module())
        owner = getattr(owner, p)
    if leaf in dict(owner.named_children()):
        raise CheckpointError(f"module '{target}' is declared twice (or inside another module)")
    owner.add_module(leaf, mod)


def graph_from_dict(data: dict, state: dict | None = None) -> fx.GraphModule:
    """Rebuild a GraphModule from :func:`graph_to_dict` output, after :func:`check_graph`.

    Without ``state``: the weights are left at their init. With ``state`` (a state_dict, e.g.
    from a file): every module's parameters and buffers are first declared from its config
    without allocation and compared with the stored tensors (shape and dtype, naming the
    module), then the modules are built and ``state`` is loaded (strict).

    Raises:
        CheckpointError: a graph the schema refuses (an unknown module type, function, method,
            keyword or node kind, a name that is not an identifier, a malformed record), or
            (with ``state``) weights that do not match their modules.
    """
    check_graph(data)
    root = nn.Module()
    try:
        for target, spec in data["modules"].items():
            kind = spec["type"]
            if kind == _NESTED:
                inner = None if state is None else {k[len(target) + 5:]: v for k, v in state.items()
                                                    if k.startswith(target + ".net.")}
                _install(root, target, _prefix_type()(graph_from_dict(spec["graph"], inner)))
                continue
            cls = _TABLE[kind][0]
            if state is None:
                mod = cls(**spec["config"])
            else:
                mod = _declared(cls, spec["config"])
                _check_against(target, mod, state)
                if any(t.is_meta for t in mod.state_dict().values()):
                    mod = mod.to_empty(device="cpu")
            _install(root, target, mod)
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        for rec in data["nodes"]:
            op, target = rec["op"], rec["target"]
            args, kwargs = _dec(rec["args"], env), _dec(rec["kwargs"], env)
            if op == "output":
                graph.output(args[0])
                continue
            if op == "call_function":
                target = FUNCTIONS[target]
            node = graph.create_node(op, target, args, kwargs, name=rec["name"])
            env[rec["name"]] = node
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed saved graph: {type(exc).__name__}: {exc}") from exc
    graph.lint()
    gm = fx.GraphModule(root, graph, "SpikingGraph")
    if state is not None:
        try:
            gm.load_state_dict(state, strict=True)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"weights do not match its graph: {exc}") from exc
    return gm
