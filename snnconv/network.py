"""The converted network (:class:`SpikingNetwork`) and its file format.

A file holds weights, thresholds, T, metadata and the graph as plain data (no pickled code), so
that ``torch.load(weights_only=True)`` reads it. Modules and functions of the graph come from
fixed tables; anything else is refused on save and on load, so loading a file never runs code
from it. Version 2 files also hold ``"digest"``, the :func:`snnconv.digest.content_digest` of
everything else in the payload, checked on load; every module's parameter shapes are computed
from its config and compared with the stored tensors before a module is built.
"""

from __future__ import annotations

import io
import numbers
import operator
import os
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .config import MAX_T
from .digest import UnverifiedFileWarning, content_digest
from .errors import CheckpointError, ConfigError, DataError, UnsupportedModelError
from .graph import largest_value
from .meta import atomic_write_bytes
from .neuron import IFNeuron, LeakyNeuron, Scale, TimeExpand, neurons

__all__ = ["FORMAT", "FORMAT_VERSION", "CHUNK_BYTES", "FUNCTIONS", "SpikingNetwork", "check_T",
           "images_per_chunk", "graph_to_dict", "graph_from_dict"]

FORMAT = "snnconv.spiking"  # the format's name, written in every file (not a module path)
#: 2: with a content digest; version 1 files (no digest) are still read, with a warning
FORMAT_VERSION = 2

# Largest value of one chunk, in SpikingNetwork's forward and in bias calibration's lockstep
# (which keeps every chunk's values alive at once): blocks above glibc's largest mmap threshold
# (32 MiB) are mapped afresh for every value, and the page faults cost more than the arithmetic
# (ResNet-18 at T=8: 7.8 million faults, 1.9x a T-step pass; 0.5 million and 1.3x in chunks
# under this size).
CHUNK_BYTES = 16 * 2**20


def check_T(T: Any, name: str = "T (number of time steps)") -> None:
    """Refuse a step count that is not an integer >= 1 (``ValueError`` naming ``name``)."""
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {T!r}")


def images_per_chunk(chunk_size: int, T: int, per_image: int) -> int:
    """Inputs per chunk of a CPU pass at ``T`` steps: ``chunk_size // T``, fewer where the largest
    value (``per_image`` bytes for one input, all T steps) would pass :data:`CHUNK_BYTES`; at
    least one."""
    return max(1, min(chunk_size // T, CHUNK_BYTES // max(1, per_image)))


class SpikingNetwork(nn.Module):
    """A converted SNN: direct encoding, IF neurons, readout averaged over ``T`` steps.

    ``snn(x)`` takes a static batch ``[B, ...]``, presents it at every step and returns the
    readout averaged over T, ``[B, classes]``. ``snn.run(x)`` returns per-step readouts
    ``[T, B, ...]`` (and per-layer spike counts on request). Neuron state starts fresh at
    every call.

    Time is folded into the batch (``[T*B, ...]`` through every layer). Without gradients on
    CPU, the batch is cut into chunks of at most ``chunk_size`` time-folded samples
    (``chunk_size // T`` inputs, fewer where a value would exceed 16 MiB) so that activations
    stay cache-sized: the same result, about 2x faster on the Fashion-MNIST ResNet-14 at T=8.
    ``chunk_size = 0`` turns this off.
    """

    def __init__(self, net: fx.GraphModule, T: int = 8):
        super().__init__()
        self.net = net
        self.meta: dict[str, Any] = {}
        self.chunk_size = 256
        self._largest: dict[tuple, int] = {}  # largest value per (graph, input shape, dtype, T)
        self.T = T

    @property
    def T(self) -> int:
        return self._T

    @T.setter
    def T(self, value: int) -> None:
        check_T(value)
        value = int(value)
        self._T = value
        for m in self.net.modules():
            if isinstance(m, (IFNeuron, LeakyNeuron, TimeExpand)):
                m.T = value

    def _steps(self, x: torch.Tensor, T: int) -> torch.Tensor:
        shape = self.meta.get("input_shape") if isinstance(self.meta, dict) else None
        if isinstance(x, torch.Tensor) and shape is not None and x.dim() != len(shape) + 1:
            raise DataError(f"the network takes a static batch [B, {', '.join(map(str, shape))}] "
                            f"(presented at each of the T steps); got an input of shape "
                            f"{tuple(x.shape)}. A sequence [T, B, ...] runs on a backend: "
                            "snnconv.backends.get('cpu').compile(export_nir(snn)).run(x)")
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise DataError(f"the input holds {int((~torch.isfinite(x)).sum())} NaN or infinite "
                            f"value(s) (shape {tuple(x.shape)}); give finite values (check the data "
                            "and its preprocessing)")
        parts = [x]
        old = self.T
        self.T = T
        try:
            if self.chunk_size and x.device.type == "cpu" and not torch.is_grad_enabled():
                parts = x.split(self._chunk_images(x, T))
            outs = [self.net(part) for part in parts]
        finally:
            self.T = old
        outs = [o.reshape(T, len(p), *o.shape[1:]) for o, p in zip(outs, parts)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _chunk_images(self, x: torch.Tensor, T: int) -> int:
        """Inputs per chunk (:func:`images_per_chunk`), the largest value measured once per input
        shape and T, on one input (ResNet-18 at T=16: a 64 MiB value per chunk of 256 samples)."""
        key = (id(self.net), tuple(x.shape[1:]), x.dtype, T)
        sizes = self._largest
        if key not in sizes:
            old = self.T
            self.T = T
            try:
                sizes[key] = largest_value(self.net, x[:1])
            finally:
                self.T = old
        return images_per_chunk(self.chunk_size, T, sizes[key])

    def forward(self, x: torch.Tensor, per_step: bool = False) -> torch.Tensor:
        """The readout averaged over T steps, ``[B, ...]`` (``per_step=True``: ``[T, B, ...]``)."""
        steps = self._steps(x, self.T)
        return steps if per_step else steps.mean(0)

    def rate(self, x: torch.Tensor, levels: int) -> torch.Tensor:
        """The network's rate function with ``levels`` quantisation steps, in one pass, ``[B, ...]``.

        Every IF neuron is replaced by the spike rate it reaches on a constant input in
        ``levels`` steps, ``clamp(floor(levels * x / theta + 1/2), 0, levels) / levels`` (QCFS),
        with a straight-through gradient; the weights are the SNN's. This is the QCFS-ANN the
        network computes when every layer's input is constant in time, and what ``snn(x)``
        tends to as T grows (for a large ``levels``): after BPTT at a few steps, compare the two
        to see what fine-tuning did to the many-step behaviour. A calibrated initial membrane
        (``IFNeuron.v_init``) is not part of this limit: every neuron uses QCFS's shift of 1/2.
        """
        check_T(levels, "levels (quantisation steps)")
        units = list(neurons(self.net).values())
        old = self.T
        self.T = 1
        try:
            for m in units:
                m.rate_levels = int(levels)
            return self.net(x)
        finally:
            for m in units:
                m.rate_levels = 0
            self.T = old

    def run(self, x: torch.Tensor, T: int | None = None, *, spike_counts: bool = False):
        """Per-step readouts ``[T, B, ...]``; with ``spike_counts``, also ``{layer: [T] counts}``.

        The counts are the number of spikes each IF layer emitted at each step, summed over
        the batch and the layer's neurons.
        """
        T = self.T if T is None else T
        check_T(T)
        T = int(T)
        counts: dict[str, torch.Tensor] = {}
        handles = []
        if spike_counts:
            for name, m in neurons(self.net).items():
                def hook(mod, inp, out, name=name):
                    # summed over the chunks of one call (see ``chunk_size``)
                    counts[name] = counts.get(name, 0) + out.detach().reshape(mod.T, -1).sum(1)
                handles.append(m.register_forward_hook(hook))
        try:
            out = self._steps(x, T)
        finally:
            for h in handles:
                h.remove()
        return (out, counts) if spike_counts else out

    def thresholds(self) -> dict[str, torch.Tensor]:
        """Each IF layer's threshold theta."""
        return {n: m.theta.detach().clone() for n, m in neurons(self.net).items()}

    # --- save / load (weights_only, no pickled code) ---

    def save(self, path: str | os.PathLike) -> None:
        """Write weights, thresholds, graph, T, metadata and their digest to ``path``.

        The file loads with ``torch.load(weights_only=True)``. ``path`` holds its old content or
        the whole new file, never a part; see :func:`snnconv.meta.atomic_write_bytes` for what an
        interrupted write leaves and when it is removed.
        """
        payload = {"format": FORMAT, "version": FORMAT_VERSION, "T": self.T,
                   "graph": graph_to_dict(self.net), "state_dict": self.net.state_dict(),
                   "meta": _plain(self.meta)}
        payload["digest"] = content_digest(payload)
        buf = io.BytesIO()
        torch.save(payload, buf)
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SpikingNetwork":
        """Read a network written by :meth:`save` (``torch.load(weights_only=True)``), in eval mode.

        A version 2 file must match its digest. Every module's parameter and buffer shapes are
        computed from its config and compared with the stored tensors before any module is
        built, so a config that declares more than the file stores allocates nothing.

        A version 1 file (no digest) loads with :class:`~snnconv.digest.UnverifiedFileWarning`.
        If it lacks a neuron's ``v_init`` (written before initial membranes were stored), that
        neuron gets the documented default: ``v[0] = theta / 2`` (``v_init = 0.5`` in units of
        theta) for reset by subtraction, ``0`` for hard reset.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: not a saved network, another format version, a digest that does
                not match, a T above :data:`snnconv.config.MAX_T`, a graph that cannot be
                rebuilt, or weights that do not match their modules (naming the layer, declared
                and stored shapes).
        """
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read {path} as a saved SpikingNetwork: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise CheckpointError(f"{path} is not a saved snnconv SpikingNetwork (format {found})")
        version = payload.get("version")
        if version not in (1, FORMAT_VERSION) or isinstance(version, bool):
            raise CheckpointError(f"{path} has format version {version!r}; this snnconv reads "
                                  f"versions 1 and {FORMAT_VERSION}")
        legacy = version == 1
        if legacy:
            warnings.warn(f"{path} is a version 1 SpikingNetwork file, without a digest: its "
                          "structure is checked, its values cannot be verified. Save it again to "
                          "add one", UnverifiedFileWarning, stacklevel=2)
        else:
            _verify(path, payload)
        T = payload.get("T")
        if isinstance(T, numbers.Integral) and not isinstance(T, bool) and T > MAX_T:
            raise CheckpointError(f"{path} declares T={T}, above the bound of {MAX_T} time steps")
        state = payload.get("state_dict")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: its state_dict is not a dict of tensors")
        try:
            net = graph_from_dict(payload["graph"], state, legacy_v_init=legacy)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        except Exception as exc:  # KeyError, TypeError, RuntimeError from fx on a damaged graph
            raise CheckpointError(f"{path}: the saved graph cannot be rebuilt: "
                                  f"{type(exc).__name__}: {exc}") from exc
        try:
            snn = cls(net, payload.get("T"))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        meta = payload.get("meta", {})
        snn.meta = meta if isinstance(meta, dict) else {}
        return snn.eval()  # freshly built modules start in training mode (dropout would be live)


def _verify(path: Any, payload: dict) -> None:
    stored = payload.get("digest")
    if not isinstance(stored, str):
        raise CheckpointError(f"{path} is a version {FORMAT_VERSION} SpikingNetwork file without "
                              "its digest: damaged or edited. Save the network again")
    try:
        actual = content_digest({k: v for k, v in payload.items() if k != "digest"})
    except TypeError as exc:
        raise CheckpointError(f"{path}: its payload holds an unexpected value: {exc}") from exc
    if actual != stored:
        raise CheckpointError(f"{path} was changed after it was saved: its content does not match "
                              "its digest (damaged or edited). Save the network again")


def _plain(obj: Any) -> Any:
    """``obj`` with tensors as lists and tuples as lists: loadable with ``weights_only=True``."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


# --- the file format: a GraphModule as plain data ---------------------------------------------

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
    # what an analog prefix (snnconv.prefix) runs once on the static input
    table["ReLU"] = (nn.ReLU, lambda m: {})
    for cls in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d):
        table[cls.__name__] = (cls, lambda m: dict(kernel_size=m.kernel_size, stride=m.stride,
                                                   padding=m.padding, dilation=m.dilation,
                                                   ceil_mode=m.ceil_mode))
    for cls in (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d):
        table[cls.__name__] = (cls, lambda m: dict(output_size=m.output_size))
    return table


#: a module holding a graph of its own (the analog prefix), saved as a nested graph
_NESTED = "AnalogPrefix"


def _prefix_type() -> type:
    from .prefix import AnalogPrefix  # imported here: the prefix pass imports the stages below

    return AnalogPrefix


#: The functions a saved graph may call, by name: the allow-list of the format.
FUNCTIONS: dict[str, Callable] = {
    f"{mod}.{fn.__name__}": fn
    for mod, fns in {
        "operator": [operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                     operator.getitem, operator.iadd, operator.imul],
        "torch": [torch.add, torch.sub, torch.mul, torch.cat, torch.flatten, torch.mean,
                  torch.sum, torch.stack, torch.reshape, torch.squeeze, torch.unsqueeze, torch.relu],
        "torch.nn.functional": [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                                F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.pad, F.dropout,
                                F.linear, F.conv1d, F.conv2d, F.conv3d,
                                # what an analog prefix (snnconv.prefix) runs once on the static input
                                F.relu, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d,
                                F.adaptive_max_pool2d, F.adaptive_max_pool3d],
        "builtins": [getattr],
    }.items()
    for fn in fns
}
_FUNCTION_NAMES = {id(fn): name for name, fn in FUNCTIONS.items()}
_METHODS = {"flatten", "view", "reshape", "size", "mean", "sum", "permute", "transpose",
            "contiguous", "add", "mul", "unsqueeze", "squeeze", "expand", "chunk", "split", "dim",
            "add_", "mul_", "float", "relu", "relu_"}
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
            if isinstance(mod, _prefix_type()):
                modules[target] = {"type": _NESTED, "graph": graph_to_dict(mod.net)}
                nodes.append({"op": node.op, "name": node.name, "target": target,
                              "args": _enc(node.args), "kwargs": _enc(node.kwargs)})
                continue
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


def _declared(cls: type, config: dict) -> nn.Module:
    """The module of ``config``; built on the meta device (nothing allocated) unless its config
    holds tensors (IFNeuron, Scale: their sizes are those of tensors stored in the file)."""
    if any(isinstance(v, torch.Tensor) for v in config.values()):
        return cls(**config)
    with torch.device("meta"):
        return cls(**config)


def _check_against(target: str, mod: nn.Module, state: dict, legacy_v_init: bool) -> None:
    """Each parameter and buffer ``mod`` declares is stored in ``state`` with its shape and dtype."""
    prefix = target + "."
    if legacy_v_init and isinstance(mod, IFNeuron) and prefix + "v_init" not in state:
        state[prefix + "v_init"] = torch.full(mod.v_init.shape, 0.5 if mod.reset == "subtract" else 0.0)
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
        if not hasattr(owner, p):
            owner.add_module(p, nn.Module())
        owner = getattr(owner, p)
    owner.add_module(leaf, mod)


def graph_from_dict(data: dict, state: dict | None = None, *,
                    legacy_v_init: bool = False) -> fx.GraphModule:
    """Rebuild a GraphModule from :func:`graph_to_dict` output.

    Without ``state``: the weights are left at their init. With ``state`` (a state_dict, e.g.
    from a file): every module's parameters and buffers are first declared from its config
    without allocation and compared with the stored tensors (shape and dtype, naming the
    module), then the modules are built and ``state`` is loaded (strict). ``legacy_v_init``:
    a missing ``IFNeuron`` ``v_init`` gets the documented default (see
    :meth:`SpikingNetwork.load`).

    Raises:
        CheckpointError: an unknown module type, function, method or node kind, a malformed
            graph, or (with ``state``) weights that do not match their modules.
    """
    table = _module_table()
    root = nn.Module()
    try:
        for target, spec in data["modules"].items():
            kind = spec["type"]
            if kind == _NESTED:
                inner = None if state is None else {k[len(target) + 5:]: v for k, v in state.items()
                                                    if k.startswith(target + ".net.")}
                _install(root, target, _prefix_type()(graph_from_dict(spec["graph"], inner)))
                continue
            if kind not in table:
                raise CheckpointError(f"unknown module type {kind!r} for '{target}'")
            cls = table[kind][0]
            if state is None:
                mod = cls(**spec["config"])
            else:
                mod = _declared(cls, spec["config"])
                _check_against(target, mod, state, legacy_v_init)
                if any(t.is_meta for t in mod.state_dict().values()):
                    mod = mod.to_empty(device="cpu")
            _install(root, target, mod)
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        for rec in data["nodes"]:
            op, target = rec["op"], rec["target"]
            args, kwargs = _dec(rec["args"], env), _dec(rec["kwargs"], env)
            if op == "call_function":
                if target not in FUNCTIONS:
                    raise CheckpointError(f"function {target!r} is not allowed in a saved graph")
                target = FUNCTIONS[target]
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
    gm = fx.GraphModule(root, graph, "SpikingGraph")
    if state is not None:
        try:
            gm.load_state_dict(state, strict=True)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"weights do not match its graph: {exc}") from exc
    return gm
