"""The `spiking` stage: replace every QCFS with an integrate-and-fire neuron (:class:`IFNeuron`).

Each neuron emits binary spikes; its output scale theta is folded into the weights of the
Conv/Linear layers that consume it (through pooling, dropout and flatten), or carried by an
explicit :class:`Scale` where no such layer exists (an identity shortcut into an add).

Time is folded into the batch: inside the network a tensor is ``[T*B, ...]`` (t major). Layers
that see only the static input (before the first neuron) run once on ``[B, ...]`` and are
expanded over time by :class:`TimeExpand`, so direct encoding costs one pass of the first layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.activation import QCFS, check_activations, relu_sites
from snnconv.errors import ConfigError, StageOrderError, UnsupportedModelError
from snnconv.graph import call_counts, describe_node, module_of, prepare
from snnconv.guards import assert_no_batchnorm
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import RESETS, IFNeuron, Scale, check_burst
from snnconv.snn.timing import insert_time_expand, unique_name

__all__ = ["LAYERS", "to_spiking"]


# --- absorbing theta into the consumers -----------------------------------------------------

_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
          nn.AdaptiveAvgPool3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_POOL_FUNCTIONS = {F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.dropout, torch.avg_pool1d}
_FLATTENS_FN = {torch.flatten}
#: The layers whose weights absorb a neuron's theta (and whose bias calibration shifts).
LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _is_flatten_from_1(gm: fx.GraphModule, node: fx.Node) -> bool:
    mod = module_of(gm, node)
    if isinstance(mod, nn.Flatten):
        return bool(mod.start_dim == 1 and mod.end_dim == -1)
    if (node.op == "call_function" and node.target in _FLATTENS_FN) or (
            node.op == "call_method" and node.target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
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
        if isinstance(mod, LAYERS):
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


def _input_scale(layer: Any, theta: torch.Tensor, flattened: bool,
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
        layer: Any = None  # the Conv or Linear that reads the neuron
        if hit is not None:
            layer = module_of(gm, hit[0])
            factor = _input_scale(layer, theta, hit[1], ndim)
        if factor is not None:
            assert hit is not None
            with torch.no_grad():
                w = (layer.weight.double() * factor.double()).to(layer.weight.dtype)
            layer.weight = nn.Parameter(w, requires_grad=True)
            absorbed.append(str(hit[0].target))
            continue
        if scale_node is None:
            name = unique_name(f"{if_node.target}_scale", used)
            gm.add_submodule(name, Scale(theta))
            with gm.graph.inserting_after(if_node):
                scale_node = gm.graph.call_module(name, (if_node,))
        user.replace_input_with(if_node, scale_node)
        scaled.append(user.name)
    return {"absorbed_into": absorbed, "explicit_scale_for": scaled}


def to_spiking(model: nn.Module, *, T: int = 8, alpha: float = 2.0,
               detach_reset: bool = False, reset: str = "subtract", burst: int = 1) -> SpikingNetwork:
    """Replace each QCFS(lambda) of a calibrated ANN by an IF neuron with threshold lambda.

    Spikes between layers are binary; lambda moves into the consuming layers' weights (or an
    explicit :class:`Scale`). Works on a copy; ``result.meta`` records what was absorbed where.
    ``reset``: ``"subtract"`` (default, the exact QCFS equivalent) or ``"zero"`` (hard reset,
    for consumers and chips whose neurons reset to zero; see :class:`IFNeuron`). ``burst`` B > 1:
    neurons that may emit up to B spikes in one step (graded spikes, subtractive reset), threshold
    lambda / B: T steps then give the T * B levels of QCFS at L = T * B.

    Raises:
        BatchNormRemainsError: the graph still holds BatchNorm.
        StageOrderError: the graph still holds a bare ReLU (run ``calibrate_qcfs`` first).
        ValueError: an unknown ``reset``.
    """
    check_T(T)
    if reset not in RESETS:
        raise ConfigError(f"reset must be one of {RESETS}, got {reset!r}")
    burst = check_burst(burst, reset)
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
    check_activations(gm, "error", stage="IF replacement")
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
        theta = q.lam.detach().clone().float() / burst
        target = str(node.target)
        base = target.replace("qcfs_", "if_", 1) if target.startswith("qcfs_") else f"if_{node.name}"
        name = unique_name(base.replace(".", "_"), used)
        gm.add_submodule(name, IFNeuron(theta, T, alpha=alpha, detach_reset=detach_reset,
                                        reset=reset, burst=burst))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        record[name] = _absorb(gm, new, theta, sites, used, getattr(q, "input_ndim", None))
        record[name]["theta"] = theta.tolist()
        record[name]["source"] = target
    expanded = insert_time_expand(gm, T, used)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    snn = SpikingNetwork(gm, T).eval()
    snn.meta = {"neurons": record, "time_expanded": expanded, "reset": reset}
    assert_no_batchnorm(snn, stage="IF replacement")
    return snn

