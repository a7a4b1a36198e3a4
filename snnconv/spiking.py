"""Stage 3: replace every QCFS with a soft-reset integrate-and-fire neuron.

Semantics (pinned here, used by every executor)::

    h[t] = v[t-1] + x[t] / theta        (the membrane is kept in units of theta)
    s[t] = 1 if h[t] >= 1 else 0        (spikingjelly's Heaviside: fires on equality)
    v[t] = h[t] - s[t]                  (reset by subtraction)
    v[0] = 1/2                          (i.e. theta / 2; per channel after membrane
                                         calibration, see :func:`calibrate_bias`)

Each neuron emits binary spikes; its output scale theta is folded into the weights of the
Conv/Linear layers that consume it (through pooling, dropout and flatten), or carried by an
explicit :class:`Scale` where no such layer exists (an identity shortcut into an add).

Time is folded into the batch: inside the network a tensor is ``[T*B, ...]`` (t major). Layers
that see only the static input (before the first neuron) run once on ``[B, ...]`` and are
expanded over time by :class:`TimeExpand`, so direct encoding costs one pass of the first layer.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import io
import math
import numbers
import operator
import os
import warnings
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import neuron, surrogate

from .errors import CheckpointError, DataError, StageOrderError, UnsupportedModelError
from .graph import (NodeOutputs, call_counts, capture, describe_node, largest_value, module_of, prepare,
                    run_lockstep)
from .guards import assert_no_batchnorm
from .meta import atomic_write_bytes
from .qcfs import QCFS, _check_activations, _FloorSTE, relu_sites

__all__ = ["RESETS", "IFNeuron", "Scale", "TimeExpand", "SpikingNetwork", "to_spiking", "calibrate_bias",
           "neurons"]

FORMAT = "snnconv.spiking"
FORMAT_VERSION = 1


def _channel_view(theta: torch.Tensor, ndim: int, channel_dim: int = 1) -> torch.Tensor:
    if theta.dim() == 0:
        return theta
    shape = [1] * ndim
    shape[channel_dim] = -1
    return theta.reshape(shape)


RESETS = ("subtract", "zero")


class IFNeuron(nn.Module):
    """Multi-step IF neuron with threshold ``theta``: reset by subtraction (default) or to zero.

    ``reset="subtract"``: wraps spikingjelly's :class:`HalfThresholdIFNode` (threshold 1) on the
    input divided by ``theta`` (``v[0] = theta / 2``; see the module docstring).
    ``reset="zero"`` (hard reset, spikingjelly's ``IFNode(v_threshold=theta, v_reset=0.)``,
    forward bit for bit)::

        h[t] = v[t-1] + x[t];  s[t] = (h[t] - theta >= 0);  v[t] = (1 - s[t]) * h[t];  v[0] = 0

    theta may be per layer (shape ``[]``) or per channel (``[C]``, dim 1) and trainable; both
    modes use the ATan surrogate gradient. The state is reset at every call, so a call is a
    pure function of its input. ``v_init`` (subtractive reset only; a buffer, never trained)
    is the initial membrane in units of theta, per layer or per channel: 1/2 (QCFS's shift)
    unless :func:`calibrate_bias` calibrated it.

    Shape:
        input ``[T*B, C, ...]`` (time-major), output: same, values in {0, 1}.
    """

    def __init__(self, theta: float | torch.Tensor, T: int = 8, *, alpha: float = 2.0,
                 detach_reset: bool = False, reset: str = "subtract",
                 v_init: float | torch.Tensor | None = None):
        super().__init__()
        theta = torch.as_tensor(theta, dtype=torch.float32).detach().clone()
        if theta.dim() > 1 or (theta <= 0).any() or not torch.isfinite(theta).all():
            raise ValueError(f"IF threshold must be positive and finite, shape [] or [C]; got {theta}")
        if reset not in RESETS:
            raise ValueError(f"IF reset must be one of {RESETS}, got {reset!r}")
        default = 0.5 if reset == "subtract" else 0.0
        v_init = torch.as_tensor(default if v_init is None else v_init, dtype=torch.float32).detach().clone()
        if v_init.dim() > 1 or not torch.isfinite(v_init).all():
            raise ValueError(f"IF v_init must be finite, shape [] or [C]; got {v_init}")
        if reset == "zero" and bool((v_init != 0).any()):
            raise ValueError("a hard-reset IF neuron starts at v = 0 (NIR's IF has no initial "
                             "membrane); v_init applies to reset='subtract' only")
        self.register_buffer("v_init", v_init)
        self.theta = nn.Parameter(theta, requires_grad=False)
        self.T = int(T)
        self.alpha = float(alpha)
        self.detach_reset = bool(detach_reset)
        self.reset = reset
        self.node = neuron.HalfThresholdIFNode(
            v_threshold=1.0, surrogate_function=surrogate.ATan(alpha=self.alpha),
            detach_reset=self.detach_reset, step_mode="m")
        self.rate_levels = 0  # > 0: compute the rate limit instead (see SpikingNetwork.rate)

    def set_surrogate(self, alpha: float | None = None, detach_reset: bool | None = None) -> None:
        """Change the surrogate sharpness or ``detach_reset`` (used by fine-tuning)."""
        if alpha is not None:
            self.alpha = float(alpha)
            self.node.surrogate_function = surrogate.ATan(alpha=self.alpha)
        if detach_reset is not None:
            self.detach_reset = bool(detach_reset)
            self.node.detach_reset = self.detach_reset

    def _hard(self, seq: torch.Tensor) -> torch.Tensor:
        theta = _channel_view(self.theta, seq.dim() - 1)
        v = torch.zeros_like(seq[0])
        spikes = []
        for x in seq:
            h = v + x
            s = self.node.surrogate_function(h - theta)  # ATan: (h - theta >= 0) forward
            spikes.append(s)
            v = (1.0 - (s.detach() if self.detach_reset else s)) * h
        return torch.stack(spikes)

    def _inference(self, seq: torch.Tensor) -> torch.Tensor:
        """The same dynamics without autograd, in place: three tensor operations per step
        instead of the surrogate's graph. Bit-identical to the training path (tested): ``h = v
        + x``; ``h - 1 >= 0`` is ``h >= 1`` in IEEE arithmetic; ``v - s`` (subtractive reset)
        and ``h - h * s`` (``(1 - s) * h`` for ``s`` in {0, 1})."""
        if self.reset == "zero":
            theta = _channel_view(self.theta, seq.dim() - 1)
            s = torch.empty_like(seq)
            v = seq[0].clone()
            for t in range(seq.shape[0]):
                if t:
                    v.add_(seq[t])
                torch.ge(v, theta, out=s[t])
                v.addcmul_(v, s[t], value=-1.0)
            return s
        # ours: the input in units of theta, its steps become spikes
        return _fire(self, seq / _channel_view(self.theta, seq.dim(), channel_dim=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate_levels:
            if self.reset != "subtract":
                raise ValueError("SpikingNetwork.rate() is the QCFS limit of subtractive-reset "
                                 "neurons; this network resets to zero")
            # the spike count of T = L steps on a constant input, divided by L: QCFS(L, theta)/theta
            L = self.rate_levels
            q = _FloorSTE.apply(x / _channel_view(self.theta, x.dim()) * L + 0.5)
            return torch.clamp(q, 0, L) / L
        TB = x.shape[0]
        if TB % self.T:
            raise ValueError(f"IFNeuron got a batch of {TB}, not a multiple of T={self.T}")
        seq = x.reshape(self.T, TB // self.T, *x.shape[1:])
        if not torch.is_grad_enabled():
            return self._inference(seq).reshape(x.shape)
        if self.reset == "zero":
            return self._hard(seq).reshape(x.shape)
        theta = _channel_view(self.theta, seq.dim(), channel_dim=2)
        self.node.reset()
        if self.v_init.dim() or float(self.v_init) != 0.5:
            # the initial membrane as a full tensor (spikingjelly uses one of x[0]'s shape)
            v0 = _channel_view(self.v_init.to(seq.dtype), seq.dim() - 1)
            self.node.v = v0.expand(seq.shape[1:]).clone()
        spikes = self.node(seq / theta)
        self.node.reset()
        return spikes.reshape(x.shape)

    def extra_repr(self) -> str:
        kind = "per-layer" if self.theta.dim() == 0 else f"per-channel[{self.theta.numel()}]"
        v0 = "" if self.v_init.dim() == 0 else f", v_init=per-channel[{self.v_init.numel()}]"
        return (f"theta={kind}, T={self.T}, reset={self.reset}, alpha={self.alpha}, "
                f"detach_reset={self.detach_reset}{v0}")


class Scale(nn.Module):
    """Multiply by ``theta`` (per layer, or per channel on dim 1): a spike train back to values."""

    def __init__(self, theta: float | torch.Tensor):
        super().__init__()
        self.theta = nn.Parameter(torch.as_tensor(theta, dtype=torch.float32).detach().clone(),
                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _channel_view(self.theta, x.dim())


class TimeExpand(nn.Module):
    """``[B, ...] -> [T*B, ...]``: the static input presented at each of T steps."""

    def __init__(self, T: int = 8):
        super().__init__()
        self.T = int(T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(self.T, *x.shape).reshape(self.T * x.shape[0], *x.shape[1:])


def neurons(model: nn.Module) -> dict[str, IFNeuron]:
    """The IF neurons of ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, IFNeuron)}


def _unique_name(base: str, used: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever is not yet a submodule name in ``used``."""
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


# --- absorbing theta into the consumers -----------------------------------------------------

_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
          nn.AdaptiveAvgPool3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_POOL_FUNCTIONS = {F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.dropout, torch.avg_pool1d}
_FLATTENS_FN = {torch.flatten}
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _is_flatten_from_1(gm: fx.GraphModule, node: fx.Node) -> bool:
    mod = module_of(gm, node)
    if isinstance(mod, nn.Flatten):
        return mod.start_dim == 1 and mod.end_dim == -1
    if (node.op == "call_function" and node.target in _FLATTENS_FN) or (
            node.op == "call_method" and node.target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    return False


def _passes_scale(gm: fx.GraphModule, node: fx.Node) -> bool:
    mod = module_of(gm, node)
    if mod is not None:
        return isinstance(mod, _POOLS)
    return node.op == "call_function" and node.target in _POOL_FUNCTIONS


def _absorb_target(gm: fx.GraphModule, user: fx.Node, src: fx.Node, sites: dict[str, int]):
    """Follow a chain of scale-commuting single-use ops from ``src`` to a Conv/Linear consumer."""
    prev, node, flattened = src, user, False
    while True:
        others = list(node.args[1:]) + list(node.kwargs.values())
        if node.args[:1] != (prev,) or any(a is prev for a in others):
            return None
        mod = module_of(gm, node)
        if isinstance(mod, _LAYERS):
            if sites.get(str(node.target), 0) != 1:
                return None
            return node, flattened
        if not (_passes_scale(gm, node) or _is_flatten_from_1(gm, node)) or len(node.users) != 1:
            return None
        if _is_flatten_from_1(gm, node):
            if flattened:
                return None
            flattened = True
        prev, node = node, next(iter(node.users))


def _input_scale(layer: nn.Module, theta: torch.Tensor, flattened: bool,
                 ndim: int | None = None) -> torch.Tensor | None:
    """A tensor broadcasting against ``layer.weight`` that multiplies each input column by theta.

    ``ndim``: the rank of the neuron's output (None: unknown). Per-channel theta runs along
    dim 1; a Linear reads the last dim, so without a flatten only a 2-D input lines them up.
    """
    w = layer.weight
    if theta.dim() == 0:
        return theta
    C = theta.numel()
    if isinstance(layer, nn.Linear):
        n_in = w.shape[1]
        if n_in % C:
            return None
        per = n_in // C
        if not flattened and (per != 1 or ndim != 2):
            return None
        return theta.repeat_interleave(per).reshape(1, n_in)
    groups = layer.groups
    if layer.in_channels != C or flattened:
        return None
    in_pg, out_pg = layer.in_channels // groups, layer.out_channels // groups
    g = torch.arange(layer.out_channels) // out_pg
    idx = g.unsqueeze(1) * in_pg + torch.arange(in_pg).unsqueeze(0)
    return theta[idx].reshape(layer.out_channels, in_pg, *([1] * (w.dim() - 2)))


def _absorb(gm: fx.GraphModule, if_node: fx.Node, theta: torch.Tensor, sites: dict[str, int],
            used: set[str], ndim: int | None = None) -> dict:
    absorbed, scaled = [], []
    scale_node = None
    for user in list(if_node.users):
        hit = _absorb_target(gm, user, if_node, sites)
        factor = None
        if hit is not None:
            layer = module_of(gm, hit[0])
            factor = _input_scale(layer, theta, hit[1], ndim)
        if factor is not None:
            layer = module_of(gm, hit[0])
            with torch.no_grad():
                w = (layer.weight.double() * factor.double()).to(layer.weight.dtype)
            layer.weight = nn.Parameter(w, requires_grad=True)
            absorbed.append(str(hit[0].target))
            continue
        if scale_node is None:
            name = _unique_name(f"{if_node.target}_scale", used)
            gm.add_submodule(name, Scale(theta))
            with gm.graph.inserting_after(if_node):
                scale_node = gm.graph.call_module(name, (if_node,))
        user.replace_input_with(if_node, scale_node)
        scaled.append(user.name)
    return {"absorbed_into": absorbed, "explicit_scale_for": scaled}


# --- time expansion -------------------------------------------------------------------------

_SHAPE_METHODS = {"size", "dim", "numel", "shape"}


def _insert_time_expand(gm: fx.GraphModule, T: int, used: set[str]) -> list[str]:
    kind: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node.op == "placeholder":
            kind[node] = "static"
        elif node.op == "get_attr":
            kind[node] = "const"
        elif isinstance(module_of(gm, node), IFNeuron) or any(kind.get(i) == "dynamic" for i in ins):
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
                name = _unique_name(f"time_expand_{inp.name}", used)
                gm.add_submodule(name, TimeExpand(T))
                with gm.graph.inserting_after(inp):
                    expanded[inp] = gm.graph.call_module(name, (inp,))
            node.replace_input_with(inp, expanded[inp])
    return [n.name for n in expanded]


def to_spiking(model: nn.Module, *, T: int = 8, alpha: float = 2.0,
               detach_reset: bool = False, reset: str = "subtract") -> "SpikingNetwork":
    """Replace each QCFS(lambda) of a calibrated ANN by an IF neuron with threshold lambda.

    Spikes between layers are binary; lambda moves into the consuming layers' weights (or an
    explicit :class:`Scale`). Works on a copy; ``result.meta`` records what was absorbed where.
    ``reset``: ``"subtract"`` (default, the exact QCFS equivalent) or ``"zero"`` (hard reset,
    for consumers and chips whose neurons reset to zero; see :class:`IFNeuron`).

    Raises:
        BatchNormRemainsError: the graph still holds BatchNorm.
        StageOrderError: the graph still holds a bare ReLU (run ``calibrate_qcfs`` first).
        ValueError: an unknown ``reset``.
    """
    _check_T(T)
    if reset not in RESETS:
        raise ValueError(f"reset must be one of {RESETS}, got {reset!r}")
    T = int(T)
    gm = prepare(model, leaf_types=(QCFS,))
    assert_no_batchnorm(gm, stage="before IF replacement")
    bare = relu_sites(gm)
    if bare:
        listing = ", ".join(describe_node(n) for n in bare)
        raise StageOrderError(
            f"{len(bare)} bare ReLU call site(s) remain: {listing}. IF neurons replace QCFS "
            "activations, whose thresholds come from calibration; run snnconv.calibrate_qcfs "
            "(or snnconv.convert) first.")
    _check_activations(gm, "error", stage="IF replacement")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(out_node.args[0], fx.Node):
        raise UnsupportedModelError(
            f"the model returns {type(out_node.args[0]).__name__}, not one tensor; the spiking "
            "network averages a single readout over time. Return one tensor from forward().")
    sites = call_counts(gm)
    record = {}
    used = {n for n, _ in gm.named_modules()}
    for node in list(gm.graph.nodes):
        q = module_of(gm, node)
        if not isinstance(q, QCFS):
            continue
        theta = q.lam.detach().clone().float()
        target = str(node.target)
        base = target.replace("qcfs_", "if_", 1) if target.startswith("qcfs_") else f"if_{node.name}"
        name = _unique_name(base.replace(".", "_"), used)
        gm.add_submodule(name, IFNeuron(theta, T, alpha=alpha, detach_reset=detach_reset,
                                                reset=reset))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        record[name] = _absorb(gm, new, theta, sites, used, getattr(q, "input_ndim", None))
        record[name]["theta"] = theta.tolist()
        record[name]["source"] = target
    expanded = _insert_time_expand(gm, T, used)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    snn = SpikingNetwork(gm, T).eval()
    snn.meta = {"neurons": record, "time_expanded": expanded, "reset": reset}
    assert_no_batchnorm(snn, stage="IF replacement")
    return snn


class _StopRun(Exception):
    pass


class _RunUntil(fx.Interpreter):
    """Run a graph until node ``name`` and return its value (the rest is not computed)."""

    def __init__(self, gm: fx.GraphModule, name: str):
        super().__init__(gm)
        self.name = name
        self.value = None

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name == self.name:
            self.value = out
            raise _StopRun
        return out


def _value_at(gm: fx.GraphModule, x: torch.Tensor, name: str) -> torch.Tensor:
    interp = _RunUntil(gm, name)
    try:
        with torch.no_grad():
            interp.run(x)
    except _StopRun:
        pass
    return interp.value


def _channel_sums(v: torch.Tensor) -> torch.Tensor:
    """Per channel (dim 1), the sum of ``v`` in float64: each image's positions summed in
    float32 first (a contiguous reduction; no float64 copy of ``v``)."""
    if v.dim() > 2:
        v = v.reshape(v.shape[0], v.shape[1], -1).sum(2)
    return v.double().sum(0)


def _channel_mean(v: torch.Tensor) -> torch.Tensor:
    return _channel_sums(v) / (v.numel() // v.shape[1])


def _bias_path(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The Conv/Linear node whose bias shifts the input of IF ``node``, and the nodes between.

    Through TimeExpand, or one argument of an add (the first Conv/Linear among its arguments).
    """
    src = node.args[0]
    path = []
    while isinstance(module_of(gm, src), TimeExpand):
        path.append(src)
        src = src.args[0]
    if isinstance(module_of(gm, src), _LAYERS):
        return src, path
    if src.op == "call_function" and src.target in (operator.add, torch.add):
        for a in src.args:
            inner = []
            while isinstance(a, fx.Node) and isinstance(module_of(gm, a), TimeExpand):
                inner.append(a)
                a = a.args[0]
            if isinstance(a, fx.Node) and isinstance(module_of(gm, a), _LAYERS):
                return a, path + [src] + inner
    return None


def _bias_layer(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The Conv/Linear whose bias shifts the input of IF ``node`` (through TimeExpand or an add)."""
    hit = _bias_path(gm, node)
    return None if hit is None else module_of(gm, hit[0])


def _shift_reaches_only(gm: fx.GraphModule, node: fx.Node, hit: tuple[fx.Node, list[fx.Node]],
                        calls: dict[str, int]) -> bool:
    """Whether a bias shift of the layer in ``hit`` reaches IF ``node`` and nothing else."""
    layer_node, path = hit
    if calls.get(str(layer_node.target), 0) != 1:
        return False
    return all(len(n.users) == 1 for n in [layer_node, *path])


def _apply_shift(layer: nn.Module, delta: torch.Tensor) -> torch.Tensor:
    """Add ``delta`` (per output channel, or its mean) to ``layer``'s bias; return what was added."""
    delta = delta.to(layer.weight.dtype)
    with torch.no_grad():
        if layer.bias is None:
            layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype,
                                                  device=layer.weight.device))
        shift = delta.reshape(-1) if delta.numel() == layer.bias.numel() else delta.mean()
        before = layer.bias.detach().clone()
        layer.bias += shift
        return layer.bias.detach() - before


@contextlib.contextmanager
def _levels(ref: fx.GraphModule, levels: int | None):
    """Every QCFS of ``ref`` at ``levels`` quantisation steps inside (``None``: as it is)."""
    mods = [module_of(ref, n) for n in ref.graph.nodes
            if n.op == "call_module" and isinstance(module_of(ref, n), QCFS)]
    old = [m.L for m in mods]
    if levels:
        for m in mods:
            m.L = int(levels)
    try:
        yield
    finally:
        for m, L in zip(mods, old):
            m.L = L


def _reference_means(ref: fx.GraphModule, ref_nodes: dict, batches: list, levels: int | None) -> dict:
    """Per QCFS site of ``ref``: its per-channel mean output over ``batches``, with every QCFS
    at ``levels`` quantisation steps (``None``: as it is)."""
    means: dict[str, torch.Tensor] = {}
    with _levels(ref, levels):
        for x in batches:
            values = capture(ref, (x,), ref_nodes.values(), reduce=_channel_mean)
            for target, name in ref_nodes.items():
                means[target] = means.get(target, 0) + values[name] / len(batches)
    return means


def _bias_setup(snn: "SpikingNetwork", reference: nn.Module, loader: Any, T: int | None,
                num_batches: int, horizons: tuple[int, int] | None = None, membrane: bool = False,
                weights: bool = False):
    """Calibration batches, the reference's per-channel mean output per QCFS site (a pair of
    them, at ``L = T1`` and ``L = T2``, with ``horizons``; T is then T2), the copy, the
    checked horizons (a pair of ints, or None) and the weight fit (:class:`_Weights`, or None).
    ``membrane``: the reference at ``L = T``."""
    from .data import split_batch

    if not isinstance(snn, SpikingNetwork) or "neurons" not in snn.meta:
        raise StageOrderError("calibrate_bias needs a SpikingNetwork made by to_spiking (its meta "
                              "maps each neuron to its QCFS site)")
    if horizons is not None and membrane:
        raise ValueError("membrane=True calibrates at one T; give T, not horizons")
    if membrane:
        _check_subtractive(snn, "membrane calibration", "calibrate its bias instead: membrane=False")
    if horizons is not None:
        horizons = _check_horizons(snn, horizons)
        T = horizons[1]
    T = snn.T if T is None else T
    _check_T(T)
    batches = []
    for batch in loader:
        if len(batches) >= num_batches:
            break
        batches.append(split_batch(batch, where="bias calibration loader")[0])
    if not batches:
        raise DataError("the bias calibration loader is empty: it yielded no batch")
    ref = prepare(reference, leaf_types=(QCFS,))
    ref_nodes = {str(n.target): n.name for n in ref.graph.nodes
                 if n.op == "call_module" and isinstance(module_of(ref, n), QCFS)}
    device = next(snn.parameters()).device
    ref.to(device)
    batches = [x.to(device) for x in batches]
    out = copy.deepcopy(snn)
    # the membrane's reference means come from the weight fit's reference pass (both at L = T)
    fit = _Weights(out.net, ref, batches, T, ref_nodes if membrane else None) if weights else None
    if fit is not None and fit.means is not None:
        target_mean: Any = fit.means
    elif horizons is None:
        target_mean = _reference_means(ref, ref_nodes, batches, T if membrane else None)
    else:
        target_mean = tuple(_reference_means(ref, ref_nodes, batches, h) for h in horizons)
    return T, batches, target_mean, out, horizons, fit


def _check_horizons(snn: "SpikingNetwork", horizons: Any) -> tuple[int, int]:
    if (not isinstance(horizons, (tuple, list)) or len(horizons) != 2
            or any(isinstance(h, bool) or not isinstance(h, numbers.Integral) for h in horizons)
            or not 1 <= horizons[0] < horizons[1]):
        raise ValueError(f"horizons must be two integers 1 <= T1 < T2, got {horizons!r}")
    _check_subtractive(snn, "membrane calibration (horizons)", "calibrate it at one T instead")
    return int(horizons[0]), int(horizons[1])


def _check_subtractive(snn: "SpikingNetwork", what: str, instead: str) -> None:
    """Refuse ``what`` (it moves the initial membrane) on a network with hard-reset neurons."""
    hard = [n for n, m in neurons(snn.net).items() if m.reset != "subtract"]
    if hard:
        raise ValueError(f"{what} needs subtractive-reset neurons; {hard[0]} resets to zero ({instead})")


def _spike_counts(mod: "IFNeuron", seq: torch.Tensor, steps: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per channel (dim 1 of a step), the spikes of IF ``mod`` on the input ``seq`` ``[T, b,
    ...]`` over the first ``t`` steps, summed over the images and positions, for each ``t`` in
    ``steps`` (float64). The same arithmetic as :meth:`IFNeuron._inference`, step by step, but
    the spike train is never stored: a running count per position is all calibration needs."""
    step = seq[0]
    dims = [d for d in range(step.dim()) if d != 1]
    counts, wanted = {}, set(steps)
    cnt = torch.zeros_like(step)
    spk = torch.empty_like(step)
    if mod.reset == "zero":
        theta = _channel_view(mod.theta, step.dim())
        v = step.clone()
    else:
        theta = _channel_view(mod.theta, step.dim())
        buf = torch.empty_like(step)
        v = step / theta + _channel_view(mod.v_init.to(step.dtype), step.dim())
    for t in range(max(steps)):
        if mod.reset == "zero":
            if t:
                v.add_(seq[t])
            torch.ge(v, theta, out=spk)
            v.addcmul_(v, spk, value=-1.0)
        else:
            if t:
                v.add_(torch.div(seq[t], theta, out=buf))
            torch.ge(v, 1.0, out=spk)
            v.sub_(spk)
        cnt.add_(spk)
        if t + 1 in wanted:
            counts[t + 1] = cnt.double().sum(dim=dims)
    return counts


def _charge_counts(mod: "IFNeuron", u: torch.Tensor, steps: tuple[int, ...],
                   charges: list | None = None) -> dict[int, torch.Tensor]:
    """:func:`_spike_counts` of a subtractive-reset neuron on its input already divided by
    theta (``u``, ``[T, b, ...]``), without a running count: after ``t`` steps a position has
    fired ``v_init + u[0] + ... + u[t-1] - v[t]`` times (its charge in, minus what is left), so
    the channel sums of ``u`` and of the membrane at the wanted steps give the same counts up to
    float rounding, for three tensor operations per step instead of five. ``charges`` (a list)
    receives each position's charge over all the steps of ``u``, for :func:`_fire`'s rates."""
    step = u[0]
    v0 = _channel_view(mod.v_init.to(step.dtype), step.dim())
    per_channel = step.numel() // step.shape[1]
    counts, charge, done, total = {}, 0.0, 0, None
    spk = torch.empty_like(step)
    v = step + v0
    for t in range(max(steps)):
        if t:
            v.add_(u[t])
        torch.ge(v, 1.0, out=spk)
        v.sub_(spk)
        if t + 1 in steps:
            if charges is None:
                # positions summed in float32 first (a float64 reduction over these strided
                # dimensions is 20x slower)
                charge = charge + _channel_sums(u[done:t + 1].reshape(-1, *step.shape[1:]))
            else:
                part = u[done:t + 1].sum(0)  # each position's charge over these steps
                total = part if total is None else total + part
                charge = charge + _channel_sums(part)
            done = t + 1
            start = mod.v_init.double().expand(step.shape[1]) * per_channel
            counts[t + 1] = start + charge - _channel_sums(v)
    if charges is not None:
        charges.append(total if done == len(u) else None)
    return counts


def _fire(mod: "IFNeuron", u: torch.Tensor, shift: torch.Tensor | None = None,
          charge: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The spikes, in place of ``u`` (``[T, b, ...]``, the input divided by theta), of the
    subtractive-reset IF neuron ``mod``. With ``shift`` (per channel, in units of theta) the
    input is raised by it at every step: the membrane is kept without the shift and compared
    with ``1 - (t+1) * shift`` instead, which saves adding the shift to the input. With
    ``charge`` (each position's ``u`` summed over the steps, from :func:`_charge_counts`) also
    the spike rates ``[b, ...]``: the count is ``v_init + charge - v`` at the end (the kept
    membrane, exactly; rounded to the integer it is up to float rounding), no pass over the
    spikes."""
    step = u[0]
    v0 = _channel_view(mod.v_init.to(step.dtype), step.dim())
    v = step + v0
    if shift is not None:  # the thresholds of all steps at once
        steps = torch.arange(1, u.shape[0] + 1, dtype=step.dtype, device=step.device)
        shift = 1.0 - steps.reshape(-1, *[1] * shift.dim()) * shift.to(step.dtype)
    for t in range(u.shape[0]):
        if t:
            v.add_(u[t])
        torch.ge(v, 1.0 if shift is None else shift[t], out=u[t])
        v.sub_(u[t])
    if charge is None:
        return u
    return u, v.neg_().add_(charge).add_(v0).round_().div_(u.shape[0])


def _rates(mod: "IFNeuron", parts: list[tuple[dict[int, torch.Tensor], int, int]], n_batches: int,
           steps: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per channel, ``theta`` times the mean spike rate over the first ``t`` steps, for each
    ``t`` in ``steps``: the mean over the images of each calibration batch, then over the
    batches. ``parts``: (counts of :func:`_spike_counts`, positions per channel, batch index)."""
    sums = {t: [0.0] * n_batches for t in steps}
    positions = [0] * n_batches
    for counts, n, k in parts:
        positions[k] += n
        for t in steps:
            sums[t][k] = sums[t][k] + counts[t]
    theta = mod.theta.detach().double()
    return {t: sum(sums[t][k] / (positions[k] * t) for k in range(n_batches)) / n_batches * theta
            for t in steps}


def _counted(mod: "IFNeuron | None", x: torch.Tensor, T: int, k: int, steps: tuple[int, ...]):
    """One part for :func:`_rates`: the spike counts of ``mod`` on ``x`` (``[T*b, ...]``) of
    batch ``k``; with ``mod=None``, ``x`` are the spikes themselves."""
    seq = x.reshape(T, len(x) // T, *x.shape[1:])
    if mod is not None:
        counts = _spike_counts(mod, seq, steps)
    else:
        dims = [d for d in range(seq.dim() - 1) if d != 1]
        counts, acc, done = {}, None, 0
        for t in sorted(steps):  # prefix sums over time
            part = seq[done:t].sum(0)
            acc, done = (part if acc is None else acc + part), t
            counts[t] = acc.double().sum(dim=dims)
    return counts, seq[0].numel() // seq.shape[2], k


def _fit(mod: "IFNeuron", parts: list, n_batches: int, T: int, target: Any,
         horizons: tuple[int, int] | None, membrane: bool = False) -> torch.Tensor:
    """The bias shift for IF ``mod`` from its spike counts (``parts``, see :func:`_rates`); with
    ``horizons`` it also moves ``mod.v_init``. Per channel, the error to the reference mean is
    modelled as ``a + b / t`` over ``t`` steps and solved at the two horizons: ``a`` goes to the
    bias and ``b`` (input units, divided by theta) to the initial membrane, kept in ``[0, 1]``.
    ``membrane``: the error ``e`` at ``T`` steps goes to the initial membrane (``b = e * T``),
    and to the bias only what the clamp leaves."""
    if horizons is None and not membrane:
        return target - _rates(mod, parts, n_batches, (T,))[T]
    if membrane:
        t = T
        e = target - _rates(mod, parts, n_batches, (T,))[T]
        b = e * T
    else:
        (t1, t), (m1, m2) = horizons, (target[0], target[1])
        r = _rates(mod, parts, n_batches, (t1, t))
        e1, e = m1 - r[t1], m2 - r[t]
        b = (e1 - e) / (1.0 / t1 - 1.0 / t)
    th = mod.theta.detach().double()
    old = mod.v_init.double()
    v0 = (old + b / th).clamp(0.0, 1.0)
    with torch.no_grad():
        mod.v_init = v0.to(torch.float32)
    return e - (v0 - old) * th / t  # the error at t that the clamped membrane left, to the bias


def _finish(out: "SpikingNetwork", snn: "SpikingNetwork", T: int, batches: list, shifts: dict,
            method: str, horizons: tuple[int, int] | None = None, membrane: bool = False,
            wfit: "_Weights | None" = None) -> "SpikingNetwork":
    out.T = snn.T
    out.meta = copy.deepcopy(snn.meta)
    out.meta["bias_calibration"] = {"T": T, "batches": len(batches), "method": method,
                                    "mean_abs_shift": shifts}
    if horizons is not None:
        out.meta["bias_calibration"]["horizons"] = list(horizons)
    if membrane:
        out.meta["bias_calibration"]["membrane"] = True
    if wfit is not None:
        out.meta["bias_calibration"]["weights"] = {"T": wfit.T, "ridge": _RIDGE,
                                                   "relative_change": wfit.changes}
    if horizons is not None or membrane:
        out.meta["bias_calibration"]["v_init"] = {
            n: {"min": float(m.v_init.min()), "mean": float(m.v_init.mean()), "max": float(m.v_init.max())}
            for n, m in neurons(out.net).items()}
    return out


# --- weight calibration ---------------------------------------------------------------------

# Largest block of gathered input columns in the weight fit (the positions are taken in pieces).
_UNFOLD_BYTES = 64 * 2**20

# Positions (output pixels over the calibration images) each weight fit uses: all of them up
# to this many per feature of a group (the columns of the least squares), a seeded sample
# beyond. The normal equations cost positions x features^2: sampling keeps that at most a
# fixed multiple of features^3 (the solve's own cost) instead of growing with the image size.
_SAMPLES_PER_FEATURE = 16
_MIN_SAMPLES = 4096


def _weight_plan(gm: fx.GraphModule, ref: fx.GraphModule) -> dict[str, tuple[nn.Module, str, nn.Module]]:
    """The Conv2d/Linear nodes of the SNN ``gm`` whose input carries spikes (downstream of a
    neuron), each called once here and in the reference ``ref``, zero-padded: node name ->
    (layer, name of the reference node that feeds the same layer, the reference layer)."""
    calls, ref_calls = call_counts(gm), call_counts(ref)
    ref_nodes = {str(n.target): n for n in ref.graph.nodes if n.op == "call_module"}
    dynamic: set[fx.Node] = set()
    plan = {}
    for node in gm.graph.nodes:
        layer = module_of(gm, node)
        if isinstance(layer, IFNeuron) or any(a in dynamic for a in node.all_input_nodes):
            dynamic.add(node)
        if not isinstance(layer, (nn.Conv2d, nn.Linear)) or not node.args or node.args[0] not in dynamic:
            continue
        target = str(node.target)
        r = ref_nodes.get(target)
        if (r is None or calls.get(target) != 1 or ref_calls.get(target) != 1
                or not r.args or not isinstance(r.args[0], fx.Node)
                or isinstance(layer, nn.Conv2d)
                and (layer.padding_mode != "zeros" or isinstance(layer.padding, str))):
            continue
        plan[node.name] = (layer, r.args[0].name, module_of(ref, r))
    return plan


def _output_size(layer: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
    """Output positions of ``layer`` per image of ``x``: a Conv2d's output rows and columns, a
    Linear's leading dimensions."""
    if isinstance(layer, nn.Linear):
        return (x[:1].numel() // x.shape[-1],)
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = (layer.kernel_size, layer.stride, layer.dilation,
                                              layer.padding)
    return ((x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
            (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1)


def _columns(layer: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The input columns of ``layer`` on ``x`` at the output positions ``pos`` (flat indices
    over images and output pixels, in the order of :func:`_layer_output`), ``[groups,
    positions, features per group]``, features in ``F.unfold``'s order (channel, then kernel
    row and column)."""
    if isinstance(layer, nn.Linear):
        return x.reshape(-1, x.shape[-1])[pos].unsqueeze(0)
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = (layer.kernel_size, layer.stride, layer.dilation,
                                              layer.padding)
    ho, wo = _output_size(layer, x)
    n, rest = pos // (ho * wo), pos % (ho * wo)
    i, j = rest // wo * sh, rest % wo * sw
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    taps = [xp[n, :, i + a * dh, j + b * dw] for a in range(kh) for b in range(kw)]  # [P, C] each
    u = torch.stack(taps, dim=-1).reshape(len(pos), -1)
    return u.reshape(len(pos), layer.groups, -1).transpose(0, 1)


def _layer_output(layer: nn.Module, a: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """``layer`` on ``a`` without its bias, ``[positions, outputs]`` (positions: images, then
    output rows and columns; a Linear's leading dimensions); with ``pos``, at those positions
    only (from their columns: cheaper than the whole convolution for a small sample)."""
    w = layer.weight.detach().to(a.dtype)
    if pos is not None:
        u = _columns(layer, a, pos)  # [groups, P, f]
        y = torch.bmm(u, w.reshape(u.shape[0], -1, u.shape[2]).transpose(1, 2))  # [groups, P, O/g]
        return y.transpose(0, 1).reshape(len(pos), -1)
    if isinstance(layer, nn.Linear):
        return (a @ w.t()).reshape(-1, w.shape[0])
    y = F.conv2d(a, w, None, layer.stride, layer.padding, layer.dilation, layer.groups)
    return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


def _gram(u: torch.Tensor) -> torch.Tensor:
    """``u^T u`` per group (``u``: ``[groups, positions, features]``), only its upper triangle
    filled beyond the diagonal blocks: panels of 512 features against the features from
    there on, about half the multiply-adds of the full product for wide layers."""
    f = u.shape[2]
    if f <= 1024:
        return torch.bmm(u.transpose(1, 2), u)
    g = u.new_zeros(u.shape[0], f, f)
    for s in range(0, f, 512):
        g[:, s:s + 512, s:] = torch.bmm(u[:, :, s:s + 512].transpose(1, 2), u[:, :, s:])
    return g


_INT32_MAX = 2**31 - 1


def _count_gram(u: torch.Tensor, steps: int) -> torch.Tensor | None:
    """``u^T u`` (float64, full) of spike rates ``u`` (``[1, positions, features]``, each a
    count over ``steps`` steps divided by ``steps``) from the counts in int8 with int32 sums:
    exact, and on a CPU 7-9x faster than the float32 product (oneDNN's int8 GEMM; ResNet-18's
    layers of 2,304-4,608 columns). None where it does not apply: not a CPU, grouped, more
    than 127 steps, or no int8 product in this build."""
    if u.device.type != "cpu" or u.shape[0] != 1 or not 1 <= steps <= 127:
        return None
    c = (u[0] * steps).round_().to(torch.int8)
    rows = _INT32_MAX // steps**2  # no int32 sum can overflow within one product
    try:
        g = sum(torch._int_mm(p.T, p).double() for p in c.split(rows))
    except (RuntimeError, AttributeError):
        return None
    return (g / steps**2).unsqueeze(0)


class _WeightFit:
    """The normal equations of one layer's weight fit, accumulated over calibration pieces:
    ``U^T U`` (upper triangle, :func:`_gram`; exact from the spike counts where ``U`` holds
    counts over ``steps`` steps, :func:`_count_gram`), ``U^T Y`` and ``U^T 1`` per group, ``U``
    the SNN's input rates in the layer's columns at the sampled output positions and ``Y`` the
    reference layer's output there without its bias (float64). The columns of small chunks
    are gathered up to :data:`_UNFOLD_BYTES` before they are multiplied (a deep layer has a
    few positions per chunk: one product each would be slow and add a float64 matrix per
    chunk)."""

    def __init__(self, layer: nn.Module, ref_layer: nn.Module, steps: int | None = None):
        self.layer, self.ref_layer, self.steps = layer, ref_layer, steps  # steps: U holds counts / steps
        self.G, self.C, self.s = 0.0, 0.0, 0.0
        self.groups = getattr(layer, "groups", 1)
        features = layer.weight[0].numel() * self.groups  # columns of all groups
        self.rows = max(1, _UNFOLD_BYTES // (features * layer.weight.element_size()))
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, rates: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> None:
        """``rates``: the layer's input (a chunk of images); ``y``: the reference layer's
        output without bias (:func:`_layer_output`) at the positions ``pos`` of that chunk."""
        for p, t in zip(pos.split(self.rows), y.split(self.rows)):
            self.pending.append((_columns(self.layer, rates, p), t))  # [groups, P, f], [P, O]
            if sum(len(t) for _, t in self.pending) >= self.rows:
                self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        u = torch.cat([u for u, _ in self.pending], dim=1)
        t = torch.cat([t for _, t in self.pending]).to(u.dtype)
        self.pending = []
        t = t.reshape(len(t), self.groups, -1).transpose(0, 1)
        gram = _count_gram(u, self.steps) if self.steps else None
        self.G = self.G + (_gram(u).double() if gram is None else gram)
        self.C = self.C + torch.bmm(u.transpose(1, 2), t).double()
        self.s = self.s + u.sum(1).double()

    def solve(self, ridge: float) -> float:
        """Set the layer's weight to the ridge solution towards its present weight; return the
        relative change of the weight (Frobenius norms)."""
        self._flush()
        layer, ref_layer = self.layer, self.ref_layer
        w = layer.weight.detach().clone()
        gram = self.G.triu_()  # the upper triangle is complete; mirrored in place
        gram += gram.triu(1).transpose(1, 2)
        self.G = None
        g = gram.shape[0]
        wg = w.double().reshape(g, w.shape[0] // g, -1)
        lam = ridge * gram.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)  # [g]
        rhs = self.C + lam[:, None, None] * wg.transpose(1, 2)
        b, ba = layer.bias, ref_layer.bias
        if b is not None or ba is not None:
            zero = torch.zeros(w.shape[0], dtype=torch.float64, device=wg.device)
            db = (zero if ba is None else ba.detach().double().to(wg.device)) - (
                zero if b is None else b.detach().double())
            rhs = rhs + self.s[:, :, None] * db.reshape(g, 1, -1)
        a = gram
        a.diagonal(dim1=1, dim2=2).add_(lam[:, None])
        chol, info = torch.linalg.cholesky_ex(a)  # positive definite with the ridge, unless float32
        # rounding of a rank-deficient U^T U outweighs a tiny one
        new = torch.cholesky_solve(rhs, chol) if not info.any() else torch.linalg.solve(a, rhs)
        new = new.transpose(1, 2).reshape(w.shape)
        with torch.no_grad():
            layer.weight.copy_(new.to(w.dtype))
        return float((new - w.double()).norm() / w.double().norm().clamp_min(1e-12))


# Ridge of the weight fit, relative to the mean of U^T U's diagonal (per group).
_RIDGE = 1e-2


class _Weights:
    """Weight calibration of the layers of :func:`_weight_plan` at ``T`` steps: per layer and
    calibration batch, the sampled output positions (sorted flat indices; a generator of its
    own, so the same positions in every run and the global RNG untouched) and the reference
    layer's output there at ``L = T`` levels; and the fits done so far (layer -> relative
    weight change). With ``sites`` (QCFS module -> node name of ``ref``), the same reference
    pass also gives :func:`_reference_means` at ``L = T`` (``means``; None without)."""

    def __init__(self, gm: fx.GraphModule, ref: fx.GraphModule, batches: list, T: int,
                 sites: dict[str, str] | None = None):
        self.plan, self.T = _weight_plan(gm, ref), T
        names = sorted({ref_name for _, ref_name, _ in self.plan.values()} | set((sites or {}).values()))
        images = sum(len(x) for x in batches)
        gen = torch.Generator().manual_seed(0)
        self.targets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.plan}
        self.means: dict[str, torch.Tensor] | None = None if sites is None else {}
        with _levels(ref, T):
            for x in batches:
                values = capture(ref, (x,), names)
                for target, name in (sites or {}).items():  # as _reference_means
                    mean = _channel_mean(values[name])
                    self.means[target] = self.means.get(target, 0) + mean / len(batches)
                for name, (layer, ref_name, ref_layer) in self.plan.items():
                    a = values[ref_name]
                    n = len(a) * math.prod(_output_size(ref_layer, a))
                    features = ref_layer.weight[0].numel()  # per group
                    budget = max(_MIN_SAMPLES, _SAMPLES_PER_FEATURE * features) * len(a) / images
                    if budget < n:
                        pos = torch.randperm(n, generator=gen)[:math.ceil(budget)].sort().values.to(a.device)
                        self.targets[name].append((pos, _layer_output(ref_layer, a, pos)))
                    else:
                        pos = torch.arange(n, device=a.device)
                        self.targets[name].append((pos, _layer_output(ref_layer, a)))
                del values
        self.changes: dict[str, float] = {}

    def fit(self, node: fx.Node, values: Iterable, spans: list, rates: list | None = None) -> None:
        """Fit the layer of ``node`` on its input ``values`` (``[T*b, ...]`` each) of the images
        ``spans`` (batch, first, end) of the calibration: least squares over the sampled
        positions, the rates over ``T`` steps against the reference at ``L = T``. ``rates``:
        those means over the steps, where already known (``values`` is then not read)."""
        layer, _, ref_layer = self.plan[node.name]
        acc = _WeightFit(layer, ref_layer, steps=self.T if rates is not None else None)

        def add(group: list, k: int, lo: int, hi: int) -> None:
            # the chunks of one batch together: a few gathers of many positions (the rates
            # are a T-th of the spikes' size)
            part = group[0] if len(group) == 1 else torch.cat(group)
            pos, y = self.targets[node.name][k]
            per_image = math.prod(_output_size(layer, part))
            a, b = torch.searchsorted(pos, torch.tensor([lo * per_image, hi * per_image], device=pos.device))
            acc.add(part, y[a:b], pos[a:b] - lo * per_image)

        means = (x.reshape(self.T, len(x) // self.T, *x.shape[1:]).mean(0) for x in values)
        group, span = [], None
        for r, (k, lo, hi) in zip(means if rates is None else rates, spans):
            if group and (k != span[0] or lo != span[2]):
                add(group, *span)
                group = []
            span = (k, span[1] if group else lo, hi)
            group.append(r)
        if group:
            add(group, *span)
        self.changes[str(node.target)] = acc.solve(_RIDGE)
        del self.targets[node.name]


# Largest value of one calibration chunk. Lockstep keeps every chunk's values alive at once;
# blocks above glibc's largest mmap threshold (32 MiB) are mapped afresh for every value, and
# the page faults cost more than the arithmetic (ResNet-18 at T=8: 7.8 million faults, 1.9x
# a T-step pass; 0.5 million and 1.3x in chunks under this size).
_CHUNK_BYTES = 16 * 2**20


def calibrate_bias(snn: "SpikingNetwork", reference: nn.Module, loader: Any, *,
                   T: int | None = None, num_batches: int = 4,
                   horizons: tuple[int, int] | None = None, membrane: bool = False,
                   weights: bool = False) -> "SpikingNetwork":
    """Shift biases so each IF layer's mean output over ``T`` steps matches the QCFS-ANN's.

    Layer by layer in graph order (each correction sees the corrected layers before it), the
    per-channel mean of ``theta * spike rate`` on calibration data is compared with the mean
    QCFS output of the same site in ``reference`` (the model ``snn`` was made from), and the
    difference is added to the bias of the Conv/Linear feeding that neuron. This removes the
    systematic under-firing of deep layers at few steps (the light calibration of Li et al.,
    ICML 2021). Works on a copy; ``result.meta["bias_calibration"]`` records the shifts.

    A bias shift is right for one ``T`` only: calibrated at T=8, a network over-corrects at
    T=32. ``horizons=(T1, T2)`` (subtractive reset only) calibrates at two T: the
    SNN runs ``T2`` steps, and per channel the error at ``t`` steps, against the reference with
    its QCFS at ``L = t`` levels (what a t-step IF layer computes on a constant input), is
    modelled as ``a + b / t``; solved at ``t = T1`` and ``T2``, ``a`` shifts the bias and ``b``
    the neuron's initial membrane ``v_init`` (a shift of ``b`` in the first step's charge moves
    the mean over t steps by ``b / t``), clamped to ``[0, 1]`` of theta. This is the potential
    calibration of Li et al. (ICML 2021) and the error model of Bu et al. (ICLR 2022) and Hao
    et al. (AAAI 2023), fitted per channel; ``T`` is then ignored. Beyond ``T2`` the bias ``a``
    (curvature of the error between the horizons) stays and the network drifts away.

    ``membrane=True`` (subtractive reset; :func:`snnconv.convert`'s default, at twice the
    network's T) corrects through the initial membrane alone: per channel the error ``e`` at
    ``T`` steps, against the reference at ``L = T`` levels, moves ``v_init`` by ``e * T``
    (clamped to ``[0, 1]`` of theta; the bias gets only what the clamp leaves). A soft-reset IF
    layer's error falls as ``1 / t`` (its spike count is the charge in, minus a membrane that
    stays bounded), so a bias shift, which stays at every T, is right at its horizon(s) only:
    fitted as ``a + b / t`` at (8, 16), ResNet-20 fell from 75 to 61% at T=64, where the
    membrane alone converges to the ANN (benchmarks/README.md "Membrane-only calibration").

    ``weights=True`` (:func:`snnconv.convert`'s default with the membrane calibration) also
    refits the weights of every Conv2d/Linear that reads spikes, in the same pass, before its
    neuron is calibrated (the advanced calibration of Li et al., ICML 2021, solved in closed
    form): per layer, ridge least squares of the layer's output on the SNN's input rates over
    ``T`` steps (the last horizon) against the QCFS-ANN's output at ``L = T`` levels, over the
    output positions of the calibration images (all of them up to 16 per weight of an output
    channel, at least 4096; a seeded sample beyond, the same in every run), pulled towards the
    present weights (ridge ``1e-2`` of the mean diagonal of the normal matrix). It corrects
    how the spike rates of a few steps differ from the ANN's values image by image, which no
    per-channel shift can. Fitted at the network's own T (where its bias or membrane is not)
    it is right at that T only (ResNet-20: +18 points at T=8, -35 at T=16); at ``2 * T`` with
    the membrane, better at T = 4-16 on the robustness matrix and about even at T=32
    (benchmarks/README.md "Weight calibration"). It reads each layer's input without changing
    it (an observer of :func:`snnconv.graph.run_lockstep`), and keeps the reference's output
    at the sampled positions only. ``meta["bias_calibration"]["weights"]`` records each
    layer's relative weight change.

    Cost: one T-step pass of the SNN over the ``num_batches`` batches, all of them layer by
    layer in lockstep (:func:`snnconv.graph.run_lockstep`; on a CPU in chunks of at most
    ``snn.chunk_size`` time-folded samples and 16 MiB per value; memory is that of a forward
    at ``num_batches`` times the batch size, with each value made just before its first use
    and spikes that a shortcut still needs kept as bool; a ``RuntimeWarning`` says so first
    where that will not fit the free memory): at each neuron the input is divided by theta in
    place, the IF recursion on it gives the spike counts (from the membrane left at the
    horizons; the spike train is not stored) and so the shift, then the neuron fires on the
    same tensor with the shift folded into its threshold, and its spikes go on to the next
    layers (and where a fitted layer reads them, their rates over the steps, from each
    position's charge and last membrane); plus one reference forward of the QCFS-ANN per
    horizon. On a 2-core CPU about 1.2-1.4x a T-step pass, with the weight fit 1.5x (ResNet-20)
    to 1.65x (ResNet-18, whose wide layers' normal equations dominate; benchmarks/README.md). Where a
    shifted layer's output also reaches other nodes (or its module is called twice), that
    shortcut is not exact and each layer is re-run from the input instead (quadratic in depth;
    ``meta["bias_calibration"]["method"] == "rerun"``).

    Raises:
        StageOrderError: ``snn`` does not record which QCFS site each neuron came from.
        DataError: the loader is empty.
    """
    T, batches, target_mean, out, horizons, wfit = _bias_setup(snn, reference, loader, T, num_batches,
                                                               horizons, membrane, weights)
    steps = (T,) if horizons is None else horizons
    gm = out.net
    calls = call_counts(gm)
    plan, shifts = [], {}
    for node in gm.graph.nodes:
        neuron_mod = module_of(gm, node)
        if not isinstance(neuron_mod, IFNeuron):
            continue
        source = snn.meta["neurons"].get(str(node.target), {}).get("source")
        hit = _bias_path(gm, node)
        if _target(target_mean, source) is None or hit is None:
            shifts[str(node.target)] = "skipped: no QCFS reference or no bias to shift"
            continue
        if calls.get(str(node.target), 0) != 1 or not _shift_reaches_only(gm, node, hit, calls):
            return _calibrate_bias_rerun(snn, T, batches, target_mean, out, horizons, membrane, wfit)
        plan.append((node.name, neuron_mod, str(node.target), source, module_of(gm, hit[0])))
    # cache-sized chunks on a CPU (as SpikingNetwork's chunk_size), each inside one batch
    out.T = T
    per = None
    per_image = largest_value(gm, batches[0][:1])  # all T steps of one image
    _warn_if_short_of_memory(per_image, batches, T)
    if snn.chunk_size and batches[0].device.type == "cpu":
        per = max(1, min(snn.chunk_size // T, _CHUNK_BYTES // max(1, per_image)))
    chunks, owner, spans = [], [], []
    for k, x in enumerate(batches):
        lo = 0
        for c in (x.split(per) if per else [x]):
            chunks.append(c)
            owner.append(k)
            spans.append((k, lo, lo + len(c)))
            lo += len(c)

    # the spike rates of the neurons whose spikes a fitted layer reads directly: from each
    # position's charge and last membrane as the neuron fires (no pass over the spikes), kept
    # until the last such layer has been fitted
    readers: dict[str, int] = {}
    rates: dict[str, list] = {}
    if wfit is not None:
        for node in gm.graph.nodes:
            if node.name in wfit.plan and isinstance(node.args[0], fx.Node):
                readers[node.args[0].name] = readers.get(node.args[0].name, 0) + 1

    def correct(xs, node_name, mod, name, source, layer):
        along_last = isinstance(layer, nn.Linear) and xs[0].dim() > 2  # bias on the last dim
        charges = [] if node_name in readers else None
        if mod.reset == "subtract" and not along_last:
            # divide by theta once, in place (every node from the layer to this neuron has this
            # one user); count from it, then fire on it with the shift, spikes in place: no
            # second division, no pass to add the shift, no new tensor
            theta = _channel_view(mod.theta, xs[0].dim())
            us = [(x.div_(theta) if x.is_contiguous() else x / theta).reshape(T, len(x) // T, *x.shape[1:])
                  for x in xs]
            parts = [(_charge_counts(mod, u, steps, charges), u[0].numel() // u.shape[2], k)
                     for u, k in zip(us, owner)]
        else:
            us, parts = None, [_counted(mod, x, T, k, steps) for x, k in zip(xs, owner)]
        delta = _fit(mod, parts, len(batches), T, _target(target_mean, source), horizons, membrane)
        del parts
        added = _apply_shift(layer, delta)
        shifts[name] = float(delta.abs().mean())
        if us is not None:
            shift = _channel_view(added, xs[0].dim()) / _channel_view(mod.theta, xs[0].dim())
            if not charges or charges[0] is None:
                return NodeOutputs((_fire(mod, u, shift).reshape(x.shape) for u, x in zip(us, xs)),
                                   spikes=True)
            spikes, rates[node_name] = [], []
            for i, (u, x) in enumerate(zip(us, xs)):
                s, r = _fire(mod, u, shift, charges[i])
                charges[i] = None
                spikes.append(s.reshape(x.shape))
                rates[node_name].append(r)
            return NodeOutputs(spikes, spikes=True)
        view = added if along_last else _channel_view(added, xs[0].dim())
        # in place: every node from the layer to this neuron has this one user
        return [x.add_(view) if x.is_contiguous() else x + view for x in xs]

    before = {node_name: (lambda xs, nn_=node_name, m=mod, n=name, s=source, lay=layer:
                          correct(xs, nn_, m, n, s, lay))
              for node_name, mod, name, source, layer in plan}

    def fit(xs, node):
        source = node.args[0].name
        known = rates.get(source)
        if known is not None:
            readers[source] -= 1
            if not readers[source]:
                del rates[source]
        wfit.fit(node, xs, spans, known)

    observe = {}
    if wfit is not None:
        observe = {node.name: (lambda xs, n=node: fit(xs, n)) for node in gm.graph.nodes if node.name in wfit.plan}
    with torch.no_grad():
        run_lockstep(gm, chunks, before, observe)
    shifts = {n: shifts[n] for n in [str(node.target) for node in gm.graph.nodes
                                     if isinstance(module_of(gm, node), IFNeuron)] if n in shifts}
    return _finish(out, snn, T, batches, shifts, "one-pass", horizons, membrane, wfit)


def _available_bytes(device: torch.device) -> int | None:
    """Free memory where the calibration runs (CUDA's, or Linux's MemAvailable); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _warn_if_short_of_memory(per_image: int, batches: list, T: int) -> None:
    """Warn before the lockstep runs where it will not fit: an out-of-memory kill says nothing.
    It needs about twice its largest value (``per_image``, all T steps of one image) over all
    images: ResNet-18's measured peaks, 5.1 and 8.1 GiB at 16 and 32 steps, are 2.0-2.5 times
    that value (2 and 4 GiB)."""
    images = sum(len(x) for x in batches)
    need, free = 2 * per_image * images, _available_bytes(batches[0].device)
    if free is not None and need > free:
        warnings.warn(
            f"bias calibration runs its {len(batches)} batches ({images} images) together for {T} "
            f"steps: about {need / 2**30:.1f} GiB, with {free / 2**30:.1f} GiB free on {batches[0].device}; "
            "if it runs out of memory, calibrate on fewer batches (convert(calib_batches=...) below 4, "
            "calibrate_bias(num_batches=...)) or pass a loader with smaller batches",
            RuntimeWarning, stacklevel=3)


def _target(target_mean: Any, source: Any) -> Any:
    """The reference mean(s) of QCFS site ``source``, or None."""
    if isinstance(target_mean, tuple):
        return None if source not in target_mean[0] else tuple(t[source] for t in target_mean)
    return target_mean.get(source)


def _calibrate_bias_rerun(snn: "SpikingNetwork", T: int, batches: list, target_mean: Any,
                          out: "SpikingNetwork", horizons: tuple[int, int] | None = None,
                          membrane: bool = False, wfit: "_Weights | None" = None) -> "SpikingNetwork":
    """The reference algorithm: for each neuron (and layer whose weights are fitted), re-run
    the corrected network up to it."""
    out.T = T
    gm = out.net
    shifts: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if wfit is not None and node.name in wfit.plan:
            values = [_value_at(gm, x, node.args[0].name) for x in batches]
            wfit.fit(node, values, [(k, 0, len(x)) for k, x in enumerate(batches)])
        neuron_mod = module_of(gm, node)
        if not isinstance(neuron_mod, IFNeuron):
            continue
        source = snn.meta["neurons"].get(str(node.target), {}).get("source")
        layer = _bias_layer(gm, node)
        if _target(target_mean, source) is None or layer is None:
            shifts[str(node.target)] = "skipped: no QCFS reference or no bias to shift"
            continue
        values = [_value_at(gm, x, node.name) for x in batches]  # [T*b, ...] each
        parts = [_counted(None, v, T, k, (T,) if horizons is None else horizons)
                 for k, v in enumerate(values)]  # the neuron's own spikes: counted, not re-run
        delta = _fit(neuron_mod, parts, len(batches), T, _target(target_mean, source), horizons, membrane)
        _apply_shift(layer, delta)
        shifts[str(node.target)] = float(delta.abs().mean())
    return _finish(out, snn, T, batches, shifts, "rerun", horizons, membrane, wfit)


def _calibrate_bias_by_rerun(snn: "SpikingNetwork", reference: nn.Module, loader: Any, *,
                             T: int | None = None, num_batches: int = 4,
                             horizons: tuple[int, int] | None = None,
                             membrane: bool = False, weights: bool = False) -> "SpikingNetwork":
    """:func:`calibrate_bias` by the quadratic re-run algorithm (the reference in the tests)."""
    T, batches, target_mean, out, horizons, wfit = _bias_setup(snn, reference, loader, T, num_batches,
                                                               horizons, membrane, weights)
    return _calibrate_bias_rerun(snn, T, batches, target_mean, out, horizons, membrane, wfit)


def _check_T(T: Any, name: str = "T (number of time steps)") -> None:
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {T!r}")


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
        _check_T(value)
        value = int(value)
        self._T = value
        for m in self.net.modules():
            if isinstance(m, (IFNeuron, TimeExpand)):
                m.T = value

    def _steps(self, x: torch.Tensor, T: int) -> torch.Tensor:
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
        """Inputs per chunk: ``chunk_size // T``, and at most :data:`_CHUNK_BYTES` in the largest
        value (measured once per input shape and T, on one input): a larger value is mapped
        afresh by glibc at each allocation, and its page faults cost more than the arithmetic
        (ResNet-18 at T=16: a 64 MiB value per chunk of 256 samples)."""
        key = (id(self.net), tuple(x.shape[1:]), x.dtype, T)
        sizes = self._largest
        if key not in sizes:
            old = self.T
            self.T = T
            try:
                sizes[key] = largest_value(self.net, x[:1])
            finally:
                self.T = old
        return max(1, min(self.chunk_size // T, _CHUNK_BYTES // max(1, sizes[key])))

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
        _check_T(levels, "levels (quantisation steps)")
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
        _check_T(T)
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
        """Write weights, thresholds, graph and T to ``path`` atomically (loadable with weights_only)."""
        from .serialize import graph_to_dict

        payload = {"format": FORMAT, "version": FORMAT_VERSION, "T": self.T,
                   "graph": graph_to_dict(self.net), "state_dict": self.net.state_dict(),
                   "meta": _plain(self.meta)}
        buf = io.BytesIO()
        torch.save(payload, buf)
        atomic_write_bytes(path, buf.getvalue())  # never half-written

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SpikingNetwork":
        """Read a network written by :meth:`save` (``torch.load(weights_only=True)``), in eval mode."""
        from .serialize import graph_from_dict

        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read {path} as a saved SpikingNetwork: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise CheckpointError(f"{path} is not a saved snnconv SpikingNetwork (format {found})")
        if payload.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format version {payload.get('version')}; this "
                                  f"snnconv reads version {FORMAT_VERSION}")
        try:
            net = graph_from_dict(payload["graph"])
        except CheckpointError:
            raise
        except Exception as exc:  # KeyError, TypeError, RuntimeError from fx on a damaged graph
            raise CheckpointError(f"{path}: the saved graph cannot be rebuilt: "
                                  f"{type(exc).__name__}: {exc}") from exc
        state = payload["state_dict"]
        if isinstance(state, dict):  # files written before v_init existed: the default
            for name, m in net.named_modules():
                if isinstance(m, IFNeuron) and f"{name}.v_init" not in state:
                    state[f"{name}.v_init"] = m.v_init
        try:
            net.load_state_dict(state, strict=True)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: weights do not match its graph: {exc}") from exc
        try:
            snn = cls(net, payload.get("T"))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        meta = payload.get("meta", {})
        snn.meta = meta if isinstance(meta, dict) else {}
        return snn.eval()  # freshly built modules start in training mode (dropout would be live)


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
