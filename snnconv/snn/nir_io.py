"""A SpikingNetwork to and from NIR (nir 1.0.8), with exact spiking semantics.

Encoding (graph metadata ``{"producer": "snnconv", "snnconv_format": 2, "T": T, "reset": ...,
"encoding": "direct", "readout": "mean_over_T"}``; every shape batch-free; the full text, for
other consumers, is docs/nir_subtractive_reset.md). Every threshold is written one float32
step below theta (:func:`snnconv.nir.format.spec_threshold`), so that NIR's ``v > v_threshold``
is snnconv's ``v >= theta`` exactly; the neurons' metadata states ``compare=">"``.

- ``reset="subtract"`` (snnconv's default IF): three standard nodes per neuron site ``X``:
  ``X = I(r=1)`` (an integrator in absolute units that starts at 0), ``X_fire =
  Threshold(nextafter(theta/2, 0))`` and ``X_reset = Scale(-theta)``, with edges ``... -> X``,
  ``X -> X_fire``, ``X_fire -> X_reset`` and ``X_reset -> X`` (the reset, delivered at the next
  step). With ``w = theta * (v - 1/2)`` this is ``v[0] = 1/2``, ``h = v + x/theta``, fire on
  ``h >= 1``, subtract 1: snnconv's neuron step for step. ``X``'s metadata records
  ``reset="subtract"`` and ``v_init=0.5`` (in units of theta); consumers read the spikes from
  ``X_fire``.
- ``burst`` B > 1 (neurons that emit up to B spikes a step): B Thresholds ``X_fire``,
  ``X_fire2``, ..., at ``nextafter(theta * (k - v_init), 0)``, into a sum node ``X_spikes`` (a
  Scale of ones) that feeds the reset and the consumers: the count (``snnconv.nir.format``).
- ``reset="zero"``: one ``IF(r=1, v_threshold=nextafter(theta, 0), v_reset=0)`` node per site,
  metadata ``reset="zero"``, ``v_init=0.0``: NIR's own IF, and spikingjelly's
  ``IFNode(v_reset=0.)`` but for a membrane exactly at ``nextafter(theta, 0)``. Identity
  shortcuts are written as 1x1 convolutions (or linear maps) with a diagonal weight, marked
  ``snnconv_op="scale"`` (exact; spikingjelly has no ``Scale`` mapping).
- Layers: Conv1d/Conv2d (bias always written, zeros if none), Affine (Linear with bias) or
  Linear, AvgPool2d (an ``AdaptiveAvgPool2d`` becomes ``AvgPool2d`` with kernel = stride =
  input/output and ``metadata["snnconv_module"] = "AdaptiveAvgPool2d"``, since torch rounds the
  two differently), Flatten (``torch.flatten(x, 1)`` is ``Flatten(start_dim=0)``), Scale for the
  identity shortcuts, Input and Output with their shapes.
- A node with several incoming edges receives their sum in edge order; a residual add is
  several edges into the neuron that follows it. A sum with no such target becomes a
  ``Scale`` of ones with ``metadata["snnconv_op"] = "sum"`` (nir 1.0.8 cannot write Identity).
- The first layers see the static input at every step (direct encoding); the readout does not
  spike and its per-step values are averaged over T (the graph's documented convention).

Reading goes through the strict reader :func:`snnconv.nir.reader.parse`: a node means
what NIR's spec says unless snnconv's metadata states otherwise, at a time step ``dt`` chosen by
the reader (``r * dt = 1``); a file of another ``snnconv_format`` is refused. Files are
written and read by :mod:`snnconv.nir.file` (:func:`save_nir`, :func:`load_nir`, re-exported here).
"""

from __future__ import annotations

import keyword
import operator
import re
from typing import Any, Callable, cast

import nir
import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.errors import ConfigError, NIRError
from snnconv.exit_rule import META_KEY as EXIT_META_KEY
from snnconv.exit_rule import stored_rule
from snnconv.graph import describe_node, module_of
from snnconv.kinds import KINDS, NO_NIR_FORM, kind_of
from snnconv.nir.file import load_nir, save_nir
from snnconv.nir.format import (
    ADAPTIVE_AVGPOOL,
    ANALOG_PREFIX,
    CONCAT_OP,
    FORMAT_VERSION,
    INPUT_KEY,
    MODULE_KEY,
    OP_KEY,
    SCALE_OP,
    SPIKES_SUFFIX,
    SUM_OP,
    fire_threshold,
    graph_metadata,
    neuron_metadata,
    spec_threshold,
    v_init_metadata,
)
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import LEAKY_KINDS, IFNeuron, LeakyNeuron, Scale
from snnconv.snn.timing import AnalogPrefix, insert_time_expand, unique_name

__all__ = ["export_nir", "from_nir", "save_nir", "load_nir", "no_nir_form", "NIR_FORMAT_VERSION", "WRITERS",
           "READERS", "NO_NIR_FORM"]

NIR_FORMAT_VERSION = FORMAT_VERSION

_ADDS = (operator.add, torch.add)
_FLATTENS = (torch.flatten,)


class _Shapes(fx.Interpreter):
    """Run the graph once and keep every node's output shape."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.shapes[n.name] = tuple(out.shape)
        return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()


def _full(theta: torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    """``theta`` (shape ``[]`` or ``[C]``, C on dim 0 of ``shape``) broadcast to ``shape``."""
    t = _np(theta)
    if t.ndim == 1:
        t = t.reshape(t.shape[0], *([1] * (len(shape) - 1)))
    return np.ascontiguousarray(np.broadcast_to(t, shape), dtype=np.float32)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


_RESERVED = frozenset(dir(nn.Module())) | {"self", "x"}


def _attr(name: str) -> str:
    """A module attribute name for the NIR node ``name``: node names are data, so a keyword
    (``if``, ``class``), a leading digit or a name nn.Module already uses gets a prefix."""
    safe = _safe(name) or "node"
    if keyword.iskeyword(safe) or safe[0].isdigit() or safe in _RESERVED or safe.startswith("_"):
        safe = f"n_{safe}"
    return safe


class _Exporter:
    def __init__(self, snn: SpikingNetwork, shapes: dict[str, tuple[int, ...]]):
        self.snn = snn
        self.gm = snn.net
        self.shapes = shapes
        self.nodes: dict[str, nir.NIRNode] = {}
        self.edges: list[tuple[str, str]] = []
        self.value: dict[str, tuple[str, ...]] = {}  # fx node -> NIR nodes whose sum it is
        self.resets: set[str] = set()
        # identity shortcuts of a hard-reset network are written as diagonal 1x1 maps, which
        # readers without a Scale mapping (spikingjelly) run exactly
        self.hard = {getattr(m, "reset", "subtract") for m in snn.net.modules()
                     if isinstance(m, IFNeuron)} == {"zero"}

    # --- helpers ---
    def shape(self, n: Any) -> tuple[int, ...]:
        if n.name not in self.shapes:
            raise NIRError(f"fx node '{n.name}' ({describe_node(n)}) does not produce a tensor")
        return self.shapes[n.name][1:]  # batch-free

    def name(self, base: str) -> str:
        base = _safe(base) or "node"
        name, k = base, 1
        while name in self.nodes:
            name, k = f"{base}_{k}", k + 1
        return name

    def add(self, base: str, node: nir.NIRNode, sources: tuple[str, ...] = ()) -> str:
        name = self.name(base)
        self.nodes[name] = node
        self.edges.extend((s, name) for s in sources)
        return name

    def src(self, n: Any, user: fx.Node) -> tuple[str, ...]:
        if not isinstance(n, fx.Node) or n.name not in self.value:
            raise NIRError(f"fx node '{user.name}' ({describe_node(user)}) takes {n!r}, which has "
                           "no NIR form (only tensors computed from the input can flow in NIR)")
        return self.value[n.name]

    def sum_node(self, base: str, sources: tuple[str, ...], shape: tuple[int, ...]) -> str:
        return self.add(base, nir.Scale(np.ones(shape, np.float32), metadata={OP_KEY: SUM_OP}),
                        sources)

    def unsupported(self, n: fx.Node, why: str = "") -> NIRError:
        mod = module_of(self.gm, n)
        what = (f"module '{n.target}' of type {type(mod).__name__}" if mod is not None
                else f"fx node '{n.name}' ({describe_node(n)})")
        known = ", ".join(c.__name__ for k in KINDS if k.name in WRITERS for c in k.modules)
        return NIRError(f"{what} has no NIR form{': ' + why if why else ''}. NIR export writes the "
                        f"modules {known}, residual adds, channel concatenations and flattens")

    # --- the walk ---
    def run(self, input_shape: tuple[int, ...]) -> None:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                if self.value:
                    raise self.unsupported(n, "the network takes more than one input")
                self.value[n.name] = (self.add("input", nir.Input(np.array(input_shape))),)
            elif n.op == "output":
                out = n.args[0]
                if not isinstance(out, fx.Node):
                    raise NIRError("the network returns more than one tensor; NIR export needs one "
                                   "readout tensor")
                self.add("output", nir.Output(np.array(self.shape(out))), self.src(out, n))
            elif n.op == "call_module":
                self.module(n)
            elif n.op == "call_function":
                self.function(n)
            elif n.op == "call_method":
                self.method(n)
            else:
                raise self.unsupported(n)

    def module(self, n: fx.Node) -> None:
        mod = module_of(self.gm, n)
        x: Any = n.args[0] if n.args else None
        if len(n.args) != 1 or n.kwargs:
            raise self.unsupported(n, "a module call with other than one tensor argument")
        srcs = self.src(x, n)
        in_shape, out_shape = self.shape(x), self.shape(n)
        if isinstance(mod, AnalogPrefix) and x.op == "placeholder" and len(x.users) == 1:
            # the static analog prefix runs once, outside the graph: its output is the input
            self.nodes[srcs[0]] = nir.Input(np.array(out_shape))
            self.value[n.name], self.prefix = srcs, out_shape
            return
        kind = kind_of(type(mod))
        write = WRITERS.get(kind.name) if kind is not None else None
        if write is None:
            raise self.unsupported(n)
        self.value[n.name] = write(self, n, mod, srcs, in_shape, out_shape)

    def avgpool(self, n: fx.Node, mod: nn.AvgPool2d) -> nir.NIRNode:
        divisor = getattr(mod, "divisor_override", None)
        if mod.ceil_mode or divisor not in (None, 1):
            raise self.unsupported(n, "ceil_mode and a divisor_override other than 1 (a sum "
                                      "pool) have no NIR form")
        pad = _pair(mod.padding)
        if any(pad) and not mod.count_include_pad and divisor is None:
            raise self.unsupported(n, "count_include_pad=False with padding has no NIR form")
        stride = _pair(mod.stride if mod.stride else mod.kernel_size)
        cls = nir.SumPool2d if divisor == 1 else nir.AvgPool2d
        return cls(kernel_size=np.array(_pair(mod.kernel_size)), stride=np.array(stride), padding=np.array(pad))

    def function(self, n: fx.Node) -> None:
        if n.target in _ADDS:
            if len(n.args) != 2 or n.kwargs or not all(isinstance(a, fx.Node) for a in n.args):
                raise self.unsupported(n, "only the sum of two tensors is a residual add")
            a, b = n.args
            if self.shape(a) != self.shape(b) or self.shape(a) != self.shape(n):
                raise self.unsupported(n, f"the add broadcasts {self.shape(a)} with {self.shape(b)}")
            left, right = self.src(a, n), self.src(b, n)
            if len(right) > 1 or set(right) & set(left):
                # (a + (b1 + b2)) rounds differently from ((a + b1) + b2): materialise the right sum
                right = (self.sum_node(f"{n.name}_rhs", right, self.shape(b)),)
            self.value[n.name] = left + right
        elif n.target in _FLATTENS:
            self.flatten_call(n)
        elif n.target in (torch.cat, torch.concat):
            self.value[n.name] = self.concat(n)
        else:
            raise self.unsupported(n)

    def concat(self, n: fx.Node) -> tuple[str, ...]:
        """A channel concatenation as the sum of one-hot 1x1 embeddings of its parts (exact:
        each output is one input times 1 plus zeros), one per part, into the consumer."""
        parts = n.args[0] if n.args else n.kwargs.get("tensors")
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        out = self.shape(n)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or dim % (len(out) + 1) != 1:
            raise self.unsupported(n, "only a concatenation of tensors along the channels (dim 1)")
        embeds, offset = [], 0
        for k, part in enumerate(parts):
            shape = self.shape(part)
            weight = np.zeros((out[0], shape[0]) + (1,) * (len(shape) - 1), np.float32)
            weight[np.arange(offset, offset + shape[0]), np.arange(shape[0])] = 1.0
            offset += shape[0]
            node = (nir.Linear(weight=weight, metadata={OP_KEY: CONCAT_OP}) if len(shape) == 1 else
                    nir.Conv2d(input_shape=tuple(int(s) for s in shape[1:]), weight=weight, stride=(1, 1),
                               padding=(0, 0), dilation=(1, 1), groups=1, bias=np.zeros(out[0], np.float32),
                               metadata={"snnconv_bias": "none", OP_KEY: CONCAT_OP}))
            if len(shape) not in (1, 3):
                raise self.unsupported(n, f"a concatenation of {len(shape)}-d parts")
            embeds.append(self.add(f"{n.name}_{k}", node, self.src(part, n)))
        return tuple(embeds)

    def method(self, n: fx.Node) -> None:
        if n.target == "flatten":
            self.flatten_call(n)
        else:
            raise self.unsupported(n)

    def flatten_call(self, n: fx.Node) -> None:
        """``torch.flatten(x, start, end)`` or ``x.flatten(start, end)``, dims by position or name."""
        start = n.args[1] if len(n.args) > 1 else n.kwargs.get("start_dim", 0)
        end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
        x = n.args[0]
        self.value[n.name] = (self.flatten(n, n.name, start, end, self.shape(x), self.src(x, n)),)

    # --- node builders ---
    def neuron(self, base: str, mod: IFNeuron, srcs: tuple[str, ...], shape: tuple[int, ...]) -> str:
        reset = getattr(mod, "reset", "subtract")
        theta = mod.theta.detach()
        if theta.dim() == 1 and (not shape or shape[0] != theta.numel()):
            raise NIRError(f"IF neuron '{base}' has {theta.numel()} per-channel thresholds but its "
                           f"input has shape {shape}")
        full = _full(theta, shape)
        self.resets.add(reset)
        if reset == "zero":
            meta = neuron_metadata("zero", 0.0, theta.dim() == 1)
            node = nir.IF(r=np.ones(shape, np.float32), v_threshold=spec_threshold(full),
                          v_reset=np.zeros(shape, np.float32), metadata=meta)
            return self.add(base, node, srcs)
        if reset != "subtract":
            raise NIRError(f"IF neuron '{base}' has reset={reset!r}; NIR export knows 'subtract' and 'zero'")
        v0 = mod.v_init.detach().cpu().to(torch.float32)
        if v0.dim() == 1 and (not shape or shape[0] != v0.numel()):
            raise NIRError(f"IF neuron '{base}' has {v0.numel()} per-channel initial membranes but "
                           f"its input has shape {shape}")
        # v_init 0.5 (QCFS's shift) as a number; calibrated ones as a list (per layer or channel)
        burst = int(getattr(mod, "burst", 1))
        meta = neuron_metadata("subtract", v_init_metadata(v0.numpy()), theta.dim() == 1, burst)
        x = self.add(base, nir.I(r=np.ones(shape, np.float32), metadata=meta), srcs)
        # the k-th spike of a step fires when v[t] - v_init >= k * theta - theta * v_init (the
        # integrator starts at 0), i.e. on v[t] - v_init > the float32 just below it (NIR's comparison)
        fires = [self.add(f"{x}_fire{k if k > 1 else ''}",
                          nir.Threshold(spec_threshold(fire_threshold(full, _full(v0, shape), k))), (x,))
                 for k in range(1, burst + 1)]
        # a burst's count: the spikes of its B thresholds summed (see snnconv.nir.format)
        out = fires[0] if burst == 1 else self.sum_node(f"{x}{SPIKES_SUFFIX}", tuple(fires), shape)
        reset_node = self.add(f"{x}_reset", nir.Scale(-full), (out,))
        self.edges.append((reset_node, x))
        return out

    def scale(self, mod: Scale, shape: tuple[int, ...]) -> nir.NIRNode:
        """A Scale node, or in a hard-reset network (when the scale is per layer or per channel)
        the same map as a 1x1 convolution or a linear map with a diagonal weight."""
        full = _full(mod.theta, shape)
        if not self.hard or len(shape) not in (1, 3):
            return nir.Scale(full)
        diag = full.reshape(shape[0], -1)
        if not (diag == diag[:, :1]).all():
            return nir.Scale(full)
        weight = np.diag(diag[:, 0]).astype(np.float32)
        meta = {OP_KEY: SCALE_OP}
        if len(shape) == 1:
            return nir.Linear(weight=weight, metadata=meta)
        return nir.Conv2d(input_shape=tuple(int(s) for s in shape[1:]), weight=weight[:, :, None, None],
                          stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                          bias=np.zeros(shape[0], np.float32), metadata=meta)

    def conv(self, n: fx.Node, mod: Any, in_shape: tuple[int, ...]) -> nir.NIRNode:
        if mod.padding_mode != "zeros":
            raise self.unsupported(n, f"padding_mode={mod.padding_mode!r} (NIR pads with zeros)")
        nd = 1 if isinstance(mod, nn.Conv1d) else 2
        padding = mod.padding
        if isinstance(padding, str):
            if padding == "valid":
                padding = (0,) * nd
            else:  # "same" (torch allows it at stride 1 only)
                total = [d * (k - 1) for d, k in zip(mod.dilation, mod.kernel_size)]
                if any(t % 2 for t in total):
                    raise self.unsupported(n, "padding='same' with an even kernel pads asymmetrically")
                padding = tuple(t // 2 for t in total)
        weight = _np(mod.weight)
        bias = _np(mod.bias) if mod.bias is not None else np.zeros(mod.out_channels, np.float32)
        meta = {} if mod.bias is not None else {"snnconv_bias": "none"}
        if nd == 1:
            return nir.Conv1d(input_shape=int(in_shape[1]), weight=weight, stride=int(mod.stride[0]),
                              padding=int(padding[0]), dilation=int(mod.dilation[0]),
                              groups=int(mod.groups), bias=bias, metadata=meta)
        node = nir.Conv2d(input_shape=tuple(int(s) for s in in_shape[1:]), weight=weight,
                          stride=tuple(int(s) for s in mod.stride), padding=tuple(int(p) for p in padding),
                          dilation=tuple(int(d) for d in mod.dilation), groups=int(mod.groups),
                          bias=bias, metadata=meta)
        # nir 1.0.8 infers the input channels as weight.shape[1] (in_channels / groups) and the
        # output size from a square kernel: both written from the module and the probed shape
        node.input_type = {"input": np.array([int(mod.in_channels), *node.input_type["input"][1:]])}
        node.output_type = {"output": np.array(self.shape(n))}
        return node

    def adaptive(self, n: fx.Node, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> nir.NIRNode:
        if len(in_shape) != 3 or any(i % o for i, o in zip(in_shape[1:], out_shape[1:])):
            raise self.unsupported(n, f"adaptive pooling from {in_shape} to {out_shape} has uneven "
                                      "windows (only sizes that divide the input map to AvgPool2d)")
        kernel = np.array([i // o for i, o in zip(in_shape[1:], out_shape[1:])])
        return nir.AvgPool2d(kernel_size=kernel, stride=kernel.copy(), padding=np.array([0, 0]),
                             metadata={MODULE_KEY: ADAPTIVE_AVGPOOL})

    def flatten(self, n: fx.Node, base: str, start: Any, end: Any, in_shape: tuple[int, ...],
                srcs: tuple[str, ...]) -> str:
        full = len(in_shape) + 1  # with the batch (time-folded) dimension
        if not isinstance(start, int) or not isinstance(end, int):
            raise self.unsupported(n, "flatten with non-constant dimensions")
        s, e = start % full, end % full
        if s == 0:
            raise self.unsupported(n, "a flatten that merges the batch dimension (start_dim=0)")
        if s > e:
            raise self.unsupported(n, f"flatten(start_dim={start}, end_dim={end})")
        node = nir.Flatten(input_type=np.array(in_shape), start_dim=s - 1,
                           end_dim=-1 if e == full - 1 else e - 1)
        return self.add(base, node, srcs)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else cast(tuple[int, int], tuple(int(x) for x in v))


def _linear(mod: nn.Linear) -> nir.NIRNode:
    w = _np(mod.weight)
    return nir.Linear(weight=w) if mod.bias is None else nir.Affine(weight=w, bias=_np(mod.bias))


_Writer = Callable[[_Exporter, fx.Node, Any, tuple[str, ...], tuple[int, ...], tuple[int, ...]], tuple[str, ...]]

#: layer kind (:data:`snnconv.kinds.KINDS`) -> its writer: ``write(exporter, node, module,
#: sources, in_shape, out_shape)`` gives the NIR nodes whose sum the module's output is (the op
#: kinds of the record's ``nir``; a kind that passes its input on gives its sources).
WRITERS: dict[str, _Writer] = {
    **{name: (lambda ex, n, m, s, i, o: s) for name in ("dropout", "identity", "time_expand")},
    "if_neuron": lambda ex, n, m, s, i, o: (ex.neuron(str(n.target), m, s, o),),
    "scale": lambda ex, n, m, s, i, o: (ex.add(str(n.target), ex.scale(m, o), s),),
    "conv": lambda ex, n, m, s, i, o: (ex.add(str(n.target), ex.conv(n, m, i), s),),
    "linear": lambda ex, n, m, s, i, o: (ex.add(str(n.target), _linear(m), s),),
    "avgpool2d": lambda ex, n, m, s, i, o: (ex.add(str(n.target), ex.avgpool(n, m), s),),
    "adaptive_avgpool2d": lambda ex, n, m, s, i, o: (ex.add(str(n.target), ex.adaptive(n, i, o), s),),
    "flatten": lambda ex, n, m, s, i, o: (ex.flatten(n, str(n.target), m.start_dim, m.end_dim, i, s),),
}


def no_nir_form(module: nn.Module) -> list[str]:
    """Every submodule of ``module`` that NIR export refuses, as ``'path' (Kind): why``: empty
    when the network (an ANN before conversion, or a SpikingNetwork) can be exported."""
    net = module.net if isinstance(module, SpikingNetwork) else module
    return [f"'{name}' ({type(m).__name__}): {NO_NIR_FORM[type(m)]}" for name, m in net.named_modules()
            if type(m) in NO_NIR_FORM]


def _probe_shapes(snn: SpikingNetwork, input_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    try:
        p = next(snn.parameters())
        device, dtype = p.device, p.dtype
    except StopIteration:
        device, dtype = torch.device("cpu"), torch.float32
    old = snn.T
    interp = _Shapes(snn.net)
    try:
        snn.T = 1
        with torch.no_grad():
            interp.run(torch.zeros(1, *input_shape, device=device, dtype=dtype))
    except Exception as exc:
        raise NIRError(f"the network rejects an input of batch-free shape {tuple(input_shape)}: "
                       f"{type(exc).__name__}: {exc}. Give export_nir(..., input_shape=(C, H, W)) "
                       "the shape it was converted with") from exc
    finally:
        snn.T = old
    return interp.shapes


def export_nir(snn: SpikingNetwork, *, input_shape: tuple[int, ...] | None = None) -> nir.NIRGraph:
    """The NIR graph of ``snn`` (see the module docstring for the encoding).

    Args:
        snn: a :class:`SpikingNetwork` (from ``convert``, ``to_spiking``, ``finetune``,
            ``SpikingNetwork.load`` or :func:`from_nir`). Dropout counts as inference-time identity.
        input_shape: batch-free input shape, e.g. ``(3, 32, 32)``; default: the shape recorded
            in ``snn.meta["input_shape"]`` by ``convert`` / ``from_nir``.

    Returns:
        a ``nir.NIRGraph`` that :func:`snnconv.nir.reader.parse` reads back exactly.

    Raises:
        NIRError: no input shape is known, or a module / fx node has no NIR form (named).
    """
    if not isinstance(snn, SpikingNetwork):
        raise NIRError(f"export_nir takes a SpikingNetwork (from snnconv.convert), got "
                       f"{type(snn).__name__}")
    if input_shape is None:
        input_shape = snn.meta.get("input_shape") if isinstance(snn.meta, dict) else None
    if input_shape is None:
        raise NIRError("the network records no input shape; give export_nir(snn, "
                       "input_shape=(C, H, W)) (batch-free)")
    try:
        input_shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise NIRError(f"input_shape {input_shape!r} is not a tuple of integers") from None
    if not input_shape or any(s < 1 for s in input_shape):
        raise NIRError(f"input_shape {input_shape} must hold positive sizes (batch-free)")
    refused = no_nir_form(snn)
    if refused:
        raise NIRError(f"{len(refused)} module(s) of the network have no NIR form: " + "; ".join(refused)
                       + ". The SpikingNetwork runs in torch; NIR and its backends need other layers there")
    ex = _Exporter(snn, _probe_shapes(snn, input_shape))
    ex.run(input_shape)
    if len(ex.resets) > 1:
        raise NIRError("the network mixes subtractive and hard-reset neurons; NIR export needs one "
                       "reset mode")
    reset = next(iter(ex.resets)) if ex.resets else "subtract"
    metadata = graph_metadata(snn.T, reset)
    if getattr(ex, "prefix", None):  # the graph reads the analog prefix's output
        metadata[INPUT_KEY] = ANALOG_PREFIX
    rule = stored_rule(snn.meta)  # a calibrated early-exit rule travels with the network
    if rule is not None:
        metadata[EXIT_META_KEY] = {"rule": rule.to_dict()}
    try:
        graph = nir.NIRGraph(nodes=ex.nodes, edges=ex.edges, metadata=metadata)
    except (ValueError, AssertionError, KeyError) as exc:
        raise NIRError(f"nir {nir.__version__} rejects the exported graph: {exc}") from exc
    return graph


# --- reading ------------------------------------------------------------------------------------

def _compact(arr: np.ndarray, where: str, what: str) -> torch.Tensor:
    """A full batch-free array that is constant per layer or per channel (dim 0), as [] or [C]."""
    flat = arr.reshape(-1)
    if (flat == flat[0]).all():
        return torch.tensor(float(flat[0]), dtype=torch.float32)
    per = arr.reshape(arr.shape[0], -1)
    if not (per == per[:, :1]).all():
        raise NIRError(f"node '{where}': the {what} varies within a channel; snnconv's Scale holds "
                       "one value per layer or per channel")
    return torch.from_numpy(np.array(per[:, 0], dtype=np.float32))  # a copy: file arrays are read-only


def _tensor(value: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(value, dtype=np.float32))


def _conv_module(op: Any, meta: dict, T: int) -> nn.Module:
    p = op.params
    cls: Any = nn.Conv1d if op.kind == "conv1d" else nn.Conv2d
    w = _tensor(p["weight"])
    has_bias = meta.get("snnconv_bias") != "none" or bool(np.any(p["bias"] != 0))
    mod = cls(op.in_shape[0], w.shape[0], tuple(w.shape[2:]), stride=p["stride"],
              padding=p["padding"], dilation=p["dilation"], groups=p["groups"], bias=has_bias)
    with torch.no_grad():
        mod.weight.copy_(w)
        if mod.bias is not None:  # (has_bias)
            mod.bias.copy_(_tensor(p["bias"]))
    return mod


def _linear_module(op: Any, meta: dict, T: int) -> nn.Module:
    w = _tensor(op.params["weight"])
    mod = nn.Linear(w.shape[1], w.shape[0], bias=op.kind == "affine")
    with torch.no_grad():
        mod.weight.copy_(w)
        if op.kind == "affine":
            mod.bias.copy_(_tensor(op.params["bias"]))
    return mod


def _avgpool_module(op: Any, meta: dict, T: int) -> nn.Module:
    p = op.params
    if p["adaptive"]:
        return nn.AdaptiveAvgPool2d(tuple(op.out_shape[1:]))
    return nn.AvgPool2d(p["kernel_size"], p["stride"], p["padding"])


def _sumpool_module(op: Any, meta: dict, T: int) -> nn.Module:
    p = op.params
    return nn.AvgPool2d(p["kernel_size"], p["stride"], p["padding"], divisor_override=1)


def _flatten_module(op: Any, meta: dict, T: int) -> nn.Module:
    start, end = op.params["start_dim"], op.params["end_dim"]  # batch-free -> batched dims
    return nn.Flatten(start + 1 if start >= 0 else start, end + 1 if end >= 0 else end)


def _scale_module(op: Any, meta: dict, T: int) -> nn.Module:
    scale = np.asarray(op.params["scale"], dtype=np.float32)
    per = scale.reshape(scale.shape[0], -1) if scale.ndim > 1 else scale.reshape(1, -1)
    if scale.ndim > 1 and not (per == per[:, :1]).all():  # per position (snnconv.constructs.pools)
        return Scale(torch.tensor(scale))
    return Scale(_compact(scale, op.name, "scale"))


def _if_module(op: Any, meta: dict, T: int) -> nn.Module:
    v0 = op.params.get("v_init")
    return IFNeuron(_tensor(op.params["theta"]), T, reset=op.params["reset"],
                    v_init=None if v0 is None else _tensor(v0), burst=op.params.get("burst", 1))


def _leaky_module(op: Any, meta: dict, T: int) -> nn.Module:
    """NIR's LIF, CubaLIF, LI: Euler coefficients at the reading's dt."""
    from snnconv.nir.leaky import leaky_params

    return LeakyNeuron(op.kind, leaky_params(op.params), T)


#: op kind -> the torch module that computes it exactly as SpikingNetwork does (input, output
#: and sum have none: the graph's placeholder, its return value and an add)
READERS = {"conv1d": _conv_module, "conv2d": _conv_module, "affine": _linear_module,
            "linear": _linear_module, "avgpool2d": _avgpool_module, "sumpool2d": _sumpool_module,
            "flatten": _flatten_module, "scale": _scale_module, "neuron": _if_module,
            **{kind: _leaky_module for kind in LEAKY_KINDS}}


def _module_for(op: Any, node: Any, T: int) -> nn.Module | None:
    """The torch module of ``op`` (None: input, output, sum)."""
    build = READERS.get(op.kind)
    return None if build is None else build(op, getattr(node, "metadata", None) or {}, T)


def from_nir(graph: nir.NIRGraph, *, T: int | None = None, dt: float = 1.0,
             compare: str | None = None) -> SpikingNetwork:
    """A :class:`SpikingNetwork` that computes ``graph`` exactly (bit for bit what was exported).

    The network has the modules ``convert`` produces (Conv/Linear/AvgPool/Flatten/Scale/
    IFNeuron, TimeExpand after the static first layers), named after the NIR nodes, so it runs,
    fine-tunes, saves (``SpikingNetwork.save``) and exports again.

    Args:
        graph: a ``nir.NIRGraph`` that :func:`snnconv.nir.reader.parse` accepts.
        T: time steps; default the T recorded in the graph's metadata, else 8.
        dt: the time step the graph is read at (an integrator with resistance ``r`` must have
            ``r * dt = 1``; spikingjelly's default export has ``r = 1e4``: ``dt=1e-4``).
        compare: the comparison of IF nodes that state none (default NIR's ``">"``; ``">="``
            reproduces a producer that simulates ``>=``, such as spikingjelly, at ties).

    Node names are data: each module's attribute name is the node's name made a Python
    identifier (a keyword such as ``if`` gets a prefix), unique within the network.

    Raises:
        NIRError: the graph is not one snnconv can run exactly (named node or edge).
    """
    from snnconv.nir.reader import parse

    parsed = parse(graph, dt=dt, compare=compare)
    T = (parsed.T or 8) if T is None else T
    check_T(T)
    T = int(T)
    root = nn.Module()
    fx_graph = fx.Graph()
    used: set[str] = set()
    env: dict[str, fx.Node] = {}
    for op in parsed.ops:
        if op.kind == "input":
            env[op.name] = fx_graph.placeholder("x")
            continue
        value = env[op.inputs[0]]
        for name in op.inputs[1:]:  # several edges: their sum, in edge order
            value = fx_graph.call_function(operator.add, (value, env[name]))
        if op.kind == "output":
            fx_graph.output(value)
            continue
        mod = _module_for(op, graph.nodes[op.name], T)
        if mod is None:  # a sum node
            env[op.name] = value
            continue
        target = unique_name(_attr(op.name), used)
        root.add_module(target, mod)
        env[op.name] = fx_graph.call_module(target, (value,))
    gm = fx.GraphModule(root, fx_graph, "SpikingGraph")
    expanded = insert_time_expand(gm, T, used)
    gm.graph.lint()
    gm.recompile()
    snn = SpikingNetwork(gm, T).eval()
    snn.meta = {"input_shape": list(parsed.input_shape), "reset": parsed.reset,
                "time_expanded": expanded, "nir": dict(parsed.metadata)}
    try:  # checked: a malformed rule is refused, naming it, as any malformed part of a graph
        rule = stored_rule(parsed.metadata)
    except ConfigError as exc:
        raise NIRError(f"the graph's metadata: {exc}") from None
    if rule is not None:
        snn.meta[EXIT_META_KEY] = {"rule": rule.to_dict()}
    return snn
