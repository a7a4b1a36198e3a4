"""The activation every ReLU call site becomes, and which graphs can become spiking.

:class:`QCFS` (Bu et al., ICLR 2022) is the function an IF neuron computes on a constant input
over L steps; :func:`relu_sites` finds the call sites it replaces, :func:`check_activations`
refuses by name what has no IF form (another activation, max-pooling, an operation between
neurons that would need analog values), and :func:`replace_maxpool` makes max-pooling average
pooling where asked.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.errors import ConfigError, UnsupportedLayerError
from snnconv.graph import describe_node, module_of, set_module
from snnconv.kinds import ACCEPTED_MODULES
from snnconv.refusals import Construct, module_path, refusal_message, source_line
from snnconv.snn.neuron import IFNeuron, Scale, TimeExpand

__all__ = ["QCFS", "FloorSTE", "hard_reset_rate", "relu_sites", "relu_input", "is_inplace", "qcfs_sites",
           "check_activations", "unsupported_constructs", "max_pools", "replace_maxpool"]

_RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, F.relu_}
_RELU_METHODS = {"relu", "relu_"}

#: Activations with no exact IF equivalent: refused by name.
_UNSUPPORTED_MODULES = (nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.SELU,
                        nn.CELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.PReLU, nn.Softplus,
                        nn.Mish, nn.RReLU, nn.GLU, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
                        nn.Softmax, nn.Threshold)
_UNSUPPORTED_FUNCTIONS = {F.gelu, F.silu, F.leaky_relu, F.leaky_relu_, torch.sigmoid, F.sigmoid,
                          torch.tanh, F.tanh, F.elu, F.elu_, F.selu, F.celu, F.hardswish,
                          F.hardsigmoid, F.relu6, F.hardtanh, F.hardtanh_, F.softplus, F.mish,
                          F.prelu, F.rrelu, F.glu, F.softsign, F.logsigmoid, F.threshold}
_UNSUPPORTED_FUNCTIONS |= {torch.selu, torch.celu, torch.special.expit, torch.softmax,
                           torch.log_softmax, F.softmax, F.log_softmax, F.softmin}
_UNSUPPORTED_METHODS = {"sigmoid", "sigmoid_", "tanh", "tanh_", "softmax", "log_softmax"}
_MAXPOOL_TO_AVG: dict[type, type] = {nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d}
_ADAPTIVE_MAX_TO_AVG: dict[type, type] = {nn.AdaptiveMaxPool1d: nn.AdaptiveAvgPool1d,
                                          nn.AdaptiveMaxPool2d: nn.AdaptiveAvgPool2d,
                                          nn.AdaptiveMaxPool3d: nn.AdaptiveAvgPool3d}
_MAX_POOLS = frozenset(_MAXPOOL_TO_AVG) | frozenset(_ADAPTIVE_MAX_TO_AVG)  # the max-pooling modules
_MAXPOOL_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d,
                      F.adaptive_max_pool2d, F.adaptive_max_pool3d, torch.max_pool2d,
                      torch.max_pool1d, torch.max_pool3d}


class FloorSTE(torch.autograd.Function):
    """``floor`` with a straight-through gradient (QCFS's, and the IF neuron's rate limit)."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        return torch.floor(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad


class _HardResetRate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, T):  # noqa: D102
        ctx.save_for_backward(u)
        period = torch.ceil(1.0 / u.clamp_min(torch.finfo(u.dtype).tiny))
        return torch.where(u > 0, torch.floor(T / period) / T, torch.zeros_like(u))

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (u,) = ctx.saved_tensors
        return grad * ((u > 0) & (u < 1)).to(grad.dtype), None


def hard_reset_rate(u: torch.Tensor, T: int) -> torch.Tensor:
    """Spikes per step of a reset-to-zero IF neuron with threshold 1 over ``T`` steps of the
    constant input ``u`` from ``v[0] = 0``: it fires every ``p = ceil(1 / u)`` steps, so
    ``floor(T / p) / T`` (0 for ``u <= 0``). The gradient is ``clip(u, 0, 1)``'s (straight
    through the staircase)."""
    return _HardResetRate.apply(u, int(T))


class QCFS(nn.Module):
    """Quantization-clip-floor-shift activation.

    .. math::
        a = \\lambda \\, \\mathrm{clip}(\\lfloor z L / \\lambda + \\varphi \\rfloor / L, 0, 1)

    ``floor`` has a straight-through gradient; ``lam`` is a trainable parameter, one value per
    layer (shape ``[]``) or per channel (shape ``[C]``, channels on dim 1 of the input).
    ``hard_T`` (an int, None by default): the rate of the reset-to-zero IF neuron that replaces
    the site instead, over ``hard_T`` steps of a constant input ``z`` from ``v[0] = 0``
    (threshold lambda, output lambda per spike; :class:`IFNeuron` with ``reset="zero"``)::

        a = lambda * floor(hard_T / ceil(lambda / z)) / hard_T   (z > 0; else 0)

    a staircase with levels lambda / p (a spike every p steps), whose gradient is passed straight
    through ``lambda * clip(z / lambda, 0, 1)``; ``L`` and ``phi`` are then unused.
    ``noise`` (a float, 0 by default; not saved): in training mode only, ``noise * N(0, 1)``
    is subtracted from every output, the noise-modelled QCFS of Hu et al. (arXiv 2404.17456),
    whose standard deviation is the spiking network's residual error at this site
    (:func:`snnconv.calibration.residual_noise`).

    Shape:
        input ``[B, C, ...]`` or ``[B, C]``; output: same.
    """

    lam: nn.Parameter

    def __init__(self, L: int = 8, lam: float | torch.Tensor = 1.0, phi: float = 0.5,
                 hard_T: int | None = None):
        super().__init__()
        if int(L) != L or L < 1:
            raise ConfigError(f"QCFS needs an integer L >= 1, got {L}")
        if hard_T is not None and (isinstance(hard_T, bool) or int(hard_T) != hard_T or hard_T < 1):
            raise ConfigError(f"QCFS hard_T must be None or an integer >= 1, got {hard_T!r}")
        self.hard_T = None if hard_T is None else int(hard_T)
        lam = torch.as_tensor(lam, dtype=torch.float32).clone()
        if lam.dim() > 1 or not torch.isfinite(lam).all() or (lam <= 0).any():
            raise ConfigError(f"QCFS lambda must be positive and finite, of shape [] or [C]; got {lam}")
        self.L = int(L)
        self.phi = float(phi)
        self.lam = nn.Parameter(lam)
        self.noise: float = 0.0

    def lam_view(self, ndim: int) -> torch.Tensor:
        """lambda shaped to broadcast over an input with ``ndim`` dimensions (channels on dim 1)."""
        if self.lam.dim() == 0:
            return self.lam
        return self.lam.reshape((1, -1) + (1,) * (ndim - 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = self.lam_view(x.dim())
        if self.hard_T is not None:
            out = lam * hard_reset_rate(x / lam, self.hard_T)
        else:
            q = FloorSTE.apply(x * (self.L / lam) + self.phi)
            out = torch.clamp(q, 0, self.L) * (lam / self.L)
        if self.training and self.noise > 0:
            out = out - self.noise * torch.randn_like(out)
        return out

    def extra_repr(self) -> str:
        shape = "per-layer" if self.lam.dim() == 0 else f"per-channel[{self.lam.numel()}]"
        if self.hard_T is not None:
            return f"hard_T={self.hard_T}, lam={shape}"
        return f"L={self.L}, phi={self.phi}, lam={shape}"


def relu_sites(gm: fx.GraphModule) -> list[fx.Node]:
    """Every ReLU call site of ``gm``: ``nn.ReLU`` calls, ``F.relu``, ``torch.relu``, ``Tensor.relu``."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(module_of(gm, node), nn.ReLU):
            sites.append(node)
        elif node.op == "call_function" and node.target in _RELU_FUNCTIONS:
            sites.append(node)
        elif node.op == "call_method" and node.target in _RELU_METHODS:
            sites.append(node)
    return sites


def relu_input(node: fx.Node) -> Any:
    """The tensor a ReLU call site reads (``F.relu(input=x)`` passes it by keyword)."""
    return node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))


def is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a ReLU call site overwrites its input (``inplace=True``, ``relu_``)."""
    mod = module_of(gm, node)
    if mod is not None:
        return bool(getattr(mod, "inplace", False))
    if node.op == "call_method":
        return node.target == "relu_"
    if node.target in (torch.relu_, F.relu_):
        return True
    return bool(node.args[1] if len(node.args) > 1 else node.kwargs.get("inplace", False))


def qcfs_sites(model: nn.Module) -> dict[str, QCFS]:
    """The QCFS modules of ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QCFS)}


def check_activations(gm: fx.GraphModule, maxpool: str, *, stage: str = "QCFS calibration") -> None:
    """Refuse, in one error, every construct without an IF form: activations other than ReLU,
    max-pooling unless ``maxpool == "avg"``, and operations between neurons that need analog
    values (:func:`unsupported_constructs`).

    Raises:
        UnsupportedLayerError: listing all of them by kind, each with its module path and fx
            node, and what to do for that kind (``.found`` holds them as :class:`Construct`).
    """
    found = unsupported_constructs(gm, maxpool)
    if found:
        raise UnsupportedLayerError(refusal_message(found, stage), found=found)


def unsupported_constructs(gm: fx.GraphModule, maxpool: str) -> list[Construct]:
    """Every construct of ``gm`` that has no IF form, in graph order (see :mod:`snnconv.refusals`)."""
    found: dict[fx.Node, Construct] = {}
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if mod is not None and isinstance(mod, _UNSUPPORTED_MODULES):
            found[node] = _construct("activation", node, type(mod).__name__)
        elif (node.op == "call_function" and node.target in _UNSUPPORTED_FUNCTIONS) or (
                node.op == "call_method" and node.target in _UNSUPPORTED_METHODS):
            found[node] = _construct("activation", node, f"{node.op} '{_name(node)}'")
        is_max = (mod is not None and type(mod) in _MAX_POOLS) or (
            node.op == "call_function" and node.target in _MAXPOOL_FUNCTIONS)
        if is_max and (maxpool != "avg" or mod is None):
            what = type(mod).__name__ if mod is not None else f"call_function '{_name(node)}'"
            hint = ("Pass maxpool='avg' to calibrate_qcfs/convert to replace it with average pooling "
                    "(retraining or QCFS training recovers the accuracy)." if mod is not None else
                    "Replace the functional call with an nn.MaxPool module or nn.AvgPool2d.")
            found[node] = _construct("max-pooling", node, what, note=hint)
    carriers = _spike_carriers(gm)
    for node in gm.graph.nodes:
        if node in carriers and node not in found:
            why = _refusal(gm, node, carriers, maxpool)
            if why is not None:
                kind, what = why
                note = _neighbours(gm, node) if kind == "normalisation" else ""
                found[node] = _construct(kind, node, what, note=note)
    gates = [c.path + "." for c in found.values() if c.kind == "product" and c.path]
    for node, c in found.items():  # a gate's activation sits inside the module that multiplies
        inside = next((g for g in gates if c.path.startswith(g)), None)
        if c.kind == "activation" and inside is not None:
            found[node] = _construct(c.kind, node, c.what, note=f"the gate of the product in '{inside[:-1]}'")
    return [found[n] for n in gm.graph.nodes if n in found]


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _construct(kind: str, node: fx.Node, what: str, note: str = "") -> Construct:
    return Construct(kind, module_path(node), node.name, what, note, source_line(node))


def _neighbours(gm: fx.GraphModule, node: fx.Node) -> str:
    """Where a normalisation sits: after the nearest activation, before the nearest weighted layer."""
    sites = set(relu_sites(gm))
    before = after = None
    seen, stack = set(), list(node.all_input_nodes)
    while stack and before is None:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n in sites or isinstance(module_of(gm, n), (QCFS,)):
            before = n
        stack.extend(n.all_input_nodes)
    frontier = list(node.users)
    while frontier and after is None:
        for n in frontier:
            if isinstance(module_of(gm, n), (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
                after = n
                break
        frontier = [u for n in frontier for u in n.users]
    parts = []
    if before is not None:
        parts.append(f"after the activation at '{module_path(before) or before.name}' (a spiking layer)")
    if after is not None:
        parts.append(f"before '{module_path(after)}'")
    return "sits " + ", ".join(parts) if parts else ""


# --- what may stand between two spiking layers ------------------------------------------------
#
# Between neurons only spike trains travel, and a layer sees the average of its input over T.
# An operation f keeps the converted network right only if the average of f over the steps is
# f of the average: linear maps (conv, linear, average pooling, sums, scaling by a constant),
# selections and rearrangements (reshape, flatten, slicing, concatenation, zero padding), and
# identities at inference (dropout). Anything else (clamp, abs, max, min, a product of two
# activations, normalisation...) is refused by name.

# the module kinds accepted: snnconv.kinds (ACCEPTED_MODULES)
_ALLOWED_FUNCTIONS = {operator.add, operator.sub, operator.neg, operator.pos, operator.getitem,
                      torch.add, torch.sub, torch.subtract, torch.neg, torch.cat, torch.concat,
                      torch.stack, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
                      torch.transpose, torch.permute, torch.chunk, torch.split, torch.narrow,
                      F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, torch.avg_pool1d,
                      F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
                      F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.linear, F.conv1d,
                      F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d, getattr,
                      builtins.len, torch.nn.functional.pad, torch.flip, torch.roll}
_ALLOWED_FUNCTIONS |= _RELU_FUNCTIONS
_ALLOWED_METHODS = {"view", "reshape", "flatten", "size", "dim", "contiguous", "permute", "transpose",
                    "squeeze", "unsqueeze", "chunk", "split", "narrow", "add", "add_", "sub", "sub_",
                    "neg", "expand", "expand_as", "view_as", "reshape_as", "float", "to", "type_as",
                    "clone", "detach", "__getitem__", "flip", "roll"} | _RELU_METHODS
_SCALING_FUNCTIONS = {operator.mul, operator.truediv, torch.mul, torch.multiply, torch.div,
                      torch.true_divide, operator.matmul, torch.matmul, torch.mm, operator.imul}
_SCALING_METHODS = {"mul", "mul_", "div", "div_", "matmul", "__mul__", "__truediv__"}
_REDUCTIONS_FUNCTIONS = {torch.mean, torch.sum}
_REDUCTION_METHODS = {"mean", "sum"}
_NORMALISATION_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                          nn.LocalResponseNorm, nn.RMSNorm)
_NORMALISATION_FUNCTIONS = {F.layer_norm, F.group_norm, F.instance_norm, F.local_response_norm,
                            F.normalize, F.rms_norm, torch.layer_norm, torch.group_norm}


def _spike_carriers(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on the output of an activation site (a neuron after conversion).

    An activation other than ReLU is a site too: replaced by ReLU, as the refusal advises, it
    becomes a neuron, so what it feeds is checked in the same pass and every construct is
    listed at once."""
    seeds = set(relu_sites(gm))
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if mod is not None and isinstance(mod, (QCFS, IFNeuron, *_UNSUPPORTED_MODULES)):
            seeds.add(node)
        elif (node.op == "call_function" and node.target in _UNSUPPORTED_FUNCTIONS) or (
                node.op == "call_method" and node.target in _UNSUPPORTED_METHODS):
            seeds.add(node)
    carriers: set[fx.Node] = set()
    for node in gm.graph.nodes:  # topological order
        if node in seeds or any(i in carriers for i in node.all_input_nodes):
            carriers.add(node)
    return carriers


def _refusal(gm: fx.GraphModule, node: fx.Node, carriers: set[fx.Node], maxpool: str
             ) -> tuple[str, str] | None:
    """Why ``node`` (reading spike trains) cannot be converted, as ``(kind, what)`` (a kind of
    :data:`snnconv.refusals.KINDS`), or None when it can."""
    if node.op in ("output", "placeholder", "get_attr"):
        return None
    mod = module_of(gm, node)
    if node.op == "call_module":
        if isinstance(mod, (*ACCEPTED_MODULES, QCFS, IFNeuron, Scale, TimeExpand)):
            return None
        if maxpool == "avg" and type(mod) in _MAX_POOLS:
            return None
        kind = "normalisation" if isinstance(mod, _NORMALISATION_MODULES) else "operation"
        return kind, f"{type(mod).__name__} module"
    target = node.target
    name = getattr(target, "__name__", str(target))
    moving = [a for a in node.all_input_nodes if a in carriers]
    if node.op == "call_function":
        if target in _ALLOWED_FUNCTIONS:
            if target is torch.nn.functional.pad:
                value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 0)
                mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
                if mode != "constant" or value not in (0, 0.0, None):
                    return "operation", (f"padding with mode {mode!r} and value {value!r} (only zero "
                                         "padding commutes)")
            return None
        if target in _SCALING_FUNCTIONS:
            if len(moving) > 1:
                return "product", f"'{name}' of two activations"
            if target in (operator.truediv, torch.div, torch.true_divide) and node.args[1:2] and \
                    node.args[1] in carriers:
                return "product", f"'{name}' by an activation"
            return None
        if target in _REDUCTIONS_FUNCTIONS:
            return _reduction_refusal(node, name, 1)
        kind = "normalisation" if target in _NORMALISATION_FUNCTIONS else "operation"
        return kind, f"'{name}'"
    if node.op == "call_method":
        if target in _ALLOWED_METHODS:
            return None
        if target in _SCALING_METHODS:
            if len(moving) > 1:
                return "product", f"'{name}' of two activations"
            if target in ("div", "div_", "__truediv__") and node.args[1:2] and node.args[1] in carriers:
                return "product", f"'{name}' by an activation"
            return None
        if target in _REDUCTION_METHODS:
            return _reduction_refusal(node, name, 1)
        return "operation", f"method '{name}'"
    return "operation", f"{node.op} '{name}'"


def _reduction_refusal(node: fx.Node, name: str, dim_pos: int) -> tuple[str, str] | None:
    dim = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get("dim")
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if dim is None or any(not isinstance(d, int) or d == 0 for d in dims):
        return "operation", f"'{name}' over the batch dimension (or all dimensions); reduce over dims >= 1 only"
    return None


def max_pools(gm: fx.GraphModule) -> list[str]:
    """The max-pooling modules of ``gm`` that ``maxpool="avg"`` would replace."""
    return [str(n.target) for n in gm.graph.nodes
            if type(module_of(gm, n)) in _MAX_POOLS]


def replace_maxpool(gm: fx.GraphModule) -> list[str]:
    """Make every max-pooling module of ``gm`` average pooling, in place (padding counted);
    returns the qualified names replaced."""
    replaced = []
    for node in gm.graph.nodes:
        mod: Any = module_of(gm, node)
        if mod is None:
            continue
        if type(mod) in _MAXPOOL_TO_AVG:
            if mod.return_indices or (mod.dilation not in (1, (1,), (1, 1), (1, 1, 1))):
                raise UnsupportedLayerError(
                    f"max-pooling at {describe_node(node)} uses dilation or return_indices, which "
                    "average pooling cannot reproduce; change the layer before converting")
            # padding counted in the average: the form NIR's AvgPool2d has (a padded max-pool is
            # another function either way; QCFS training adapts the weights to it)
            avg = _MAXPOOL_TO_AVG[type(mod)](mod.kernel_size, mod.stride, mod.padding,
                                             ceil_mode=mod.ceil_mode, count_include_pad=True)
            set_module(gm, str(node.target), avg)
            replaced.append(str(node.target))
        elif type(mod) in _ADAPTIVE_MAX_TO_AVG:
            if mod.return_indices:
                raise UnsupportedLayerError(f"{describe_node(node)} returns indices; remove that first")
            set_module(gm, str(node.target), _ADAPTIVE_MAX_TO_AVG[type(mod)](mod.output_size))
            replaced.append(str(node.target))
    return replaced
