"""Stage 2: QCFS threshold calibration.

Every ReLU call site becomes its own ``QCFS(L, lambda)`` (Bu et al., ICLR 2022)::

    a = lambda * clip(floor(z * L / lambda + phi) / L, 0, 1),   phi = 1/2

with lambda initialised from a percentile of the site's pre-activation on calibration data,
then optionally trained together with the weights (QCFS-aware ANN training).
"""

from __future__ import annotations

import builtins
import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from .progress import progress_bar

from .data import bounded, split_batch, split_loader
from .errors import ConfigError, DataError, UnsupportedLayerError
from .graph import capture, describe_node, module_of, prepare, set_module
from .guards import assert_no_batchnorm
from .metrics import TeacherLabelled, distillation_loss, evaluate, teacher_targets

__all__ = ["QCFS", "hard_reset_rate", "calibrate_qcfs", "qcfs_sites", "relu_sites", "QCFSTrainConfig", "FloorSTE",
           "check_activations"]

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
_MAXPOOL_TO_AVG = {nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d}
_ADAPTIVE_MAX_TO_AVG = {nn.AdaptiveMaxPool1d: nn.AdaptiveAvgPool1d,
                        nn.AdaptiveMaxPool2d: nn.AdaptiveAvgPool2d,
                        nn.AdaptiveMaxPool3d: nn.AdaptiveAvgPool3d}
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


def hard_reset_rate(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Spike rate of a hard-reset IF neuron (threshold 1, membrane from 0, reset to 0) over
    ``steps`` steps of the constant input ``u``: it fires every ``k = ceil(1 / u)`` steps.

    .. math::
        r(u) = \\lfloor \\mathrm{steps} / \\lceil 1 / u \\rceil \\rfloor / \\mathrm{steps}
        \\ (u > 0), \\qquad r(u) = 0 \\ (u \\le 0)

    A staircase with the levels ``floor(steps / k) / steps`` (at 8 steps: 0, 1/8, 2/8, 4/8, 1),
    where subtractive reset gives ``floor(u * steps + 1/2) / steps``. No gradient.
    """
    k = torch.ceil(1.0 / u.clamp(min=1.0 / (steps + 1)))
    return torch.where(u > 0, torch.floor(steps / k) / steps, torch.zeros_like(u))


class QCFS(nn.Module):
    """Quantization-clip-floor-shift activation, or the hard-reset neuron's rate.

    .. math::
        a = \\lambda \\, \\mathrm{clip}(\\lfloor z L / \\lambda + \\varphi \\rfloor / L, 0, 1)
        \\quad (\\texttt{reset="subtract"}), \\qquad
        a = \\lambda \\, r(z / \\lambda) \\quad (\\texttt{reset="zero"},
        :func:`hard_reset_rate` over L steps)

    ``floor`` has a straight-through gradient (``reset="zero"``: the gradient of
    ``lambda * clip(z / lambda, 0, 1)``); ``lam`` is a trainable parameter, one value per
    layer (shape ``[]``) or per channel (shape ``[C]``, channels on dim 1 of the input).
    ``reset="zero"`` is the function a hard-reset IF neuron with threshold lambda computes on a
    constant input over L steps, which QCFS training then teaches the network.

    Shape:
        input ``[B, C, ...]`` or ``[B, C]``; output: same.
    """

    def __init__(self, L: int = 8, lam: float | torch.Tensor = 1.0, phi: float = 0.5,
                 reset: str = "subtract"):
        super().__init__()
        if int(L) != L or L < 1:
            raise ConfigError(f"QCFS needs an integer L >= 1, got {L}")
        if reset not in ("subtract", "zero"):
            raise ConfigError(f"QCFS reset must be 'subtract' or 'zero', got {reset!r}")
        lam = torch.as_tensor(lam, dtype=torch.float32).clone()
        if lam.dim() > 1 or not torch.isfinite(lam).all() or (lam <= 0).any():
            raise ConfigError(f"QCFS lambda must be positive and finite, of shape [] or [C]; got {lam}")
        self.L = int(L)
        self.phi = float(phi)
        self.reset = reset
        self.lam = nn.Parameter(lam)

    def lam_view(self, ndim: int) -> torch.Tensor:
        """lambda shaped to broadcast over an input with ``ndim`` dimensions (channels on dim 1)."""
        if self.lam.dim() == 0:
            return self.lam
        return self.lam.reshape((1, -1) + (1,) * (ndim - 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = self.lam_view(x.dim())
        if self.reset == "zero":
            u = x / lam
            c = u.clamp(0, 1)
            return lam * (c + (hard_reset_rate(u.detach(), self.L) - c).detach())
        q = FloorSTE.apply(x * (self.L / lam) + self.phi)
        return torch.clamp(q, 0, self.L) * (lam / self.L)

    def extra_repr(self) -> str:
        shape = "per-layer" if self.lam.dim() == 0 else f"per-channel[{self.lam.numel()}]"
        kind = ", reset=zero" if self.reset == "zero" else ""
        return f"L={self.L}, phi={self.phi}, lam={shape}{kind}"


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


def _relu_input(node: fx.Node) -> Any:
    """The tensor a ReLU call site reads (``F.relu(input=x)`` passes it by keyword)."""
    return node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
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
    """Refuse activations other than ReLU, and max-pooling unless ``maxpool == "avg"``."""
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        bad = None
        if mod is not None and isinstance(mod, _UNSUPPORTED_MODULES):
            bad = f"{type(mod).__name__} at {describe_node(node)}"
        elif node.op == "call_function" and node.target in _UNSUPPORTED_FUNCTIONS:
            bad = describe_node(node)
        elif node.op == "call_method" and node.target in _UNSUPPORTED_METHODS:
            bad = describe_node(node)
        if bad:
            raise UnsupportedLayerError(
                f"unsupported activation {bad} found at {stage}: only ReLU maps onto "
                "integrate-and-fire neurons (QCFS). Replace it with nn.ReLU and retrain the ANN "
                "before converting.")
        is_max = (mod is not None and type(mod) in {**_MAXPOOL_TO_AVG, **_ADAPTIVE_MAX_TO_AVG}) or (
            node.op == "call_function" and node.target in _MAXPOOL_FUNCTIONS)
        if is_max and (maxpool != "avg" or mod is None):
            if mod is not None:
                hint = ("pass maxpool='avg' to calibrate_qcfs/convert to replace it with average "
                        "pooling (retraining or QCFS training recovers the accuracy)")
            else:
                hint = "replace the functional call with an nn.MaxPool module or nn.AvgPool2d"
            raise UnsupportedLayerError(
                f"max-pooling at {describe_node(node)} found at {stage}: a max over spike trains "
                f"is not the spike train of the max, so it has no exact IF equivalent; {hint}.")
    _check_between_neurons(gm, maxpool, stage)


# --- what may stand between two spiking layers ------------------------------------------------
#
# Between neurons only spike trains travel, and a layer sees the average of its input over T.
# An operation f keeps the converted network right only if the average of f over the steps is
# f of the average: linear maps (conv, linear, average pooling, sums, scaling by a constant),
# selections and rearrangements (reshape, flatten, slicing, concatenation, zero padding), and
# identities at inference (dropout). Anything else (clamp, abs, max, min, a product of two
# activations, normalisation...) is refused by name.

_ALLOWED_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                    nn.ConvTranspose3d, nn.Linear, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.Flatten,
                    nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
                    nn.ReLU, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.modules.batchnorm._BatchNorm)
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


def _spike_carriers(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on the output of an activation site (a neuron after conversion)."""
    seeds = set(relu_sites(gm))
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if mod is not None and (isinstance(mod, QCFS) or type(mod).__name__ == "IFNeuron"):
            seeds.add(node)
    carriers: set[fx.Node] = set()
    for node in gm.graph.nodes:  # topological order
        if node in seeds or any(i in carriers for i in node.all_input_nodes):
            carriers.add(node)
    return carriers


def _refusal(gm: fx.GraphModule, node: fx.Node, carriers: set[fx.Node], maxpool: str) -> str | None:
    """Why ``node`` (reading spike trains) cannot be converted, or None when it can."""
    if node.op in ("output", "placeholder", "get_attr"):
        return None
    mod = module_of(gm, node)
    if node.op == "call_module":
        if isinstance(mod, _ALLOWED_MODULES) or isinstance(mod, QCFS) or type(mod).__name__ in (
                "IFNeuron", "Scale", "TimeExpand"):
            return None
        if maxpool == "avg" and type(mod) in {**_MAXPOOL_TO_AVG, **_ADAPTIVE_MAX_TO_AVG}:
            return None
        return f"{type(mod).__name__} module"
    target = node.target
    name = getattr(target, "__name__", str(target))
    moving = [a for a in node.all_input_nodes if a in carriers]
    if node.op == "call_function":
        if target in _ALLOWED_FUNCTIONS:
            if target is torch.nn.functional.pad:
                value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 0)
                mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
                if mode != "constant" or value not in (0, 0.0, None):
                    return f"padding with mode {mode!r} and value {value!r} (only zero padding commutes)"
            return None
        if target in _SCALING_FUNCTIONS:
            if len(moving) > 1:
                return f"'{name}' of two activations (a product is not linear in the spike rates)"
            if target in (operator.truediv, torch.div, torch.true_divide) and node.args[1:2] and \
                    node.args[1] in carriers:
                return f"'{name}' by an activation"
            return None
        if target in _REDUCTIONS_FUNCTIONS:
            return _reduction_refusal(node, name, 1)
        return f"'{name}'"
    if node.op == "call_method":
        if target in _ALLOWED_METHODS:
            return None
        if target in _SCALING_METHODS:
            if len(moving) > 1:
                return f"'{name}' of two activations (a product is not linear in the spike rates)"
            if target in ("div", "div_", "__truediv__") and node.args[1:2] and node.args[1] in carriers:
                return f"'{name}' by an activation"
            return None
        if target in _REDUCTION_METHODS:
            return _reduction_refusal(node, name, 1)
        return f"method '{name}'"
    return f"{node.op} '{name}'"


def _reduction_refusal(node: fx.Node, name: str, dim_pos: int) -> str | None:
    dim = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get("dim")
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if dim is None or any(not isinstance(d, int) or d == 0 for d in dims):
        return f"'{name}' over the batch dimension (or all dimensions); reduce over dims >= 1 only"
    return None


def _check_between_neurons(gm: fx.GraphModule, maxpool: str, stage: str) -> None:
    """Refuse any operation on spike trains outside the allow-list (see above), by fx node."""
    carriers = _spike_carriers(gm)
    bad = []
    for node in gm.graph.nodes:
        if node in carriers:
            why = _refusal(gm, node, carriers, maxpool)
            if why is not None:
                bad.append(f"{why} at {describe_node(node)}")
    if bad:
        raise UnsupportedLayerError(
            f"{len(bad)} operation(s) after a ReLU found at {stage} have no spiking equivalent: "
            + "; ".join(bad) + ". Between spiking layers only operations that commute with "
            "averaging over time steps are exact: conv, linear, average pooling, flatten/reshape/"
            "view, add/sub, concatenation, slicing, zero padding, dropout, identity, scaling by a "
            "constant. Remove or replace the operation (e.g. a clamp by a ReLU, max-pooling by "
            "average pooling) and retrain the ANN.")


def max_pools(gm: fx.GraphModule) -> list[str]:
    """The max-pooling modules of ``gm`` that ``maxpool="avg"`` would replace."""
    return [str(n.target) for n in gm.graph.nodes
            if type(module_of(gm, n)) in {**_MAXPOOL_TO_AVG, **_ADAPTIVE_MAX_TO_AVG}]


def _replace_maxpool(gm: fx.GraphModule) -> list[str]:
    replaced = []
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
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


def _site_name(node: fx.Node, used: set[str]) -> str:
    name, k = f"qcfs_{node.name}", 1
    while name in used:
        name, k = f"qcfs_{node.name}_{k}", k + 1
    used.add(name)
    return name


def _percentiles(gm: fx.GraphModule, loader: Iterable, sites: list[fx.Node], *, percentile: float,
                 per_channel: bool, num_batches: int, device: torch.device,
                 progress: bool, max_samples: int = 1 << 18,
                 ndims: dict[str, int] | None = None,
                 hard_reset_steps: int | None = None) -> dict[str, torch.Tensor]:
    """Per site, lambda: the ``percentile`` of its pre-activation; with ``hard_reset_steps``
    that lambda times the factor of :data:`HARD_RESET_FACTORS` whose hard-reset rate
    (:func:`hard_reset_rate`) fits the ReLU clipped at the percentile best on the samples."""
    inputs = {s.name: _relu_input(s).name for s in sites}
    samples: dict[str, list[torch.Tensor]] = {s.name: [] for s in sites}
    gen = torch.Generator().manual_seed(0)
    seen = 0
    bar = progress_bar(total=num_batches, desc="calibrate", disable=not progress, leave=False)
    for i, batch in enumerate(loader):
        if i >= num_batches:
            break
        x, _ = split_batch(batch, where="calibration loader")
        _check_finite(x, f"calibration batch {i}")
        values = capture(gm, (x.to(device),), set(inputs.values()))
        for site, src in inputs.items():
            # samples stay on the calibration device (the quantiles run there: on a GPU, much
            # faster than on one CPU thread); the subsampling indices come from a CPU generator
            v = values[src].detach().float()
            if ndims is not None:
                ndims[site] = v.dim()
            if per_channel:
                v = v.transpose(0, 1).reshape(v.shape[1], -1)
                if v.shape[1] > max_samples // max(1, v.shape[0]) * 4:
                    keep = torch.randperm(v.shape[1], generator=gen)[: max(1, max_samples // v.shape[0]) * 4]
                    v = v[:, keep.to(v.device)]
            else:
                v = v.reshape(-1)
                if v.numel() > max_samples:
                    v = v[torch.randperm(v.numel(), generator=gen)[:max_samples].to(v.device)]
            samples[site].append(v)
        seen += 1
        bar.update(1)
    bar.close()
    if seen == 0:
        raise DataError("the calibration loader is empty: it yielded no batch. QCFS thresholds "
                        "are set from data; pass a loader with at least one batch.")
    q = percentile / 100.0
    out = {}
    for site, chunks in samples.items():
        if per_channel:
            v = torch.cat(chunks, dim=1)
            lam = torch.quantile(v, q, dim=1) if v.shape[1] <= 16_000_000 else v.max(dim=1).values
        else:
            v = torch.cat(chunks)
            lam = torch.quantile(v[: 16_000_000], q)
        lam = lam.clamp_min(1e-3)
        out[site] = lam if hard_reset_steps is None else lam * _hard_reset_factor(v, lam, hard_reset_steps)
    return out


#: lambda's factors tried for a hard-reset site: its staircase lies under the identity (inputs in
#: [lambda/2, lambda) give lambda/2), so the best fit of the clipped ReLU has a lower lambda.
HARD_RESET_FACTORS = tuple(k / 20 for k in range(4, 21))


def _hard_reset_factor(v: torch.Tensor, lam: torch.Tensor, steps: int) -> torch.Tensor:
    """The factor of :data:`HARD_RESET_FACTORS` (per channel where ``v`` is ``[C, N]``) of
    least squared error between ``f lam r(v / (f lam))`` and ``clip(v, 0, lam)``."""
    lam = lam.reshape(-1, 1) if v.dim() == 2 else lam
    v = v.float()
    target = torch.minimum(v.clamp_min(0), lam)
    best = torch.full(v.shape[:-1] if v.dim() == 2 else (), float("inf"), device=v.device)
    factor = torch.ones_like(best)
    for f in HARD_RESET_FACTORS:
        err = ((f * lam * hard_reset_rate(v / (f * lam), steps) - target) ** 2).mean(-1)
        factor = torch.where(err < best, torch.full_like(factor, f), factor)
        best = torch.minimum(best, err)
    return factor.reshape(-1) if v.dim() == 2 else factor


def _check_finite(x: torch.Tensor, where: str) -> None:
    if x.is_floating_point() and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise DataError(f"{where} holds {bad} NaN/inf value(s); clean the data before converting")


@dataclass(frozen=True)
class QCFSTrainConfig:
    """QCFS-aware ANN training settings (validated on construction).

    ``max_steps`` bounds the optimiser steps over all epochs (None: every batch of every epoch);
    the cosine schedule spans the steps that run, and the epoch it ends in is validated.
    ``distill`` in [0, 1] mixes distillation from a teacher (``calibrate_qcfs(teacher=)``, the
    ANN before QCFS) into the loss, as in fine-tuning (:func:`snnconv.metrics.distillation_loss`
    at ``distill_temperature``); at 1 the loader needs no labels and the validation split
    scores agreement with the teacher."""

    epochs: int = 0
    optimizer: str = "sgd"
    lr: float = 0.01
    lambda_lr: float | None = None
    weight_decay: float = 5e-4
    momentum: float = 0.9
    label_smoothing: float = 0.0
    val_fraction: float = 0.1
    seed: int = 0
    max_steps: int | None = None
    distill: float = 0.0
    distill_temperature: float = 2.0

    def __post_init__(self):
        if not 0 <= self.distill <= 1:
            raise ConfigError(f"distill must be in [0, 1], got {self.distill}")
        if self.distill_temperature <= 0:
            raise ConfigError(f"distill_temperature must be positive, got {self.distill_temperature}")
        if self.epochs < 0 or int(self.epochs) != self.epochs:
            raise ConfigError(f"epochs must be a non-negative integer, got {self.epochs}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or int(self.max_steps) != self.max_steps
                                           or self.max_steps < 1):
            raise ConfigError(f"max_steps must be None or an integer >= 1, got {self.max_steps!r}")
        if self.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.lr <= 0 or (self.lambda_lr is not None and self.lambda_lr <= 0):
            raise ConfigError(f"learning rates must be positive, got lr={self.lr}, lambda_lr={self.lambda_lr}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")


def make_optimizer(model: nn.Module, name: str, lr: float, *, weight_decay: float,
                   momentum: float = 0.9, threshold_lr: float | None = None,
                   threshold_params: Iterable[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW; weight decay only on weight tensors, never on thresholds/biases."""
    thresholds = {id(p) for p in threshold_params}
    decay, no_decay, thr = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in thresholds:
            thr.append(p)
        elif p.dim() > 1:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if thr:
        groups.append({"params": thr, "weight_decay": 0.0, "lr": threshold_lr or lr})
    groups = [g for g in groups if g["params"]]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    return torch.optim.AdamW(groups, lr=lr)


_NEEDS_LABELS = ("QCFS training needs labels, but the loader yields inputs only. Pass a loader of "
                 "(x, y) batches, distill=1.0 with a teacher to learn from its outputs alone, or "
                 "qcfs_epochs=0 to calibrate only.")


def _train_qcfs(gm: fx.GraphModule, loader: Iterable, cfg: QCFSTrainConfig, device: torch.device,
                progress: bool, summary: dict[str, Any], teacher: nn.Module | None) -> list[dict[str, float]]:
    """Train weights and lambdas; keep the best epoch on the validation split, where the
    calibrated state counts as epoch 0 (``summary`` gets ``calibrated_val_acc`` and ``best_epoch``)."""
    few = not isinstance(loader, DataLoader) and (_length(loader) or 2) < 2
    # a single batch holds nothing out: train on it without best-epoch selection
    train, val = split_loader(loader, 0.0 if few else cfg.val_fraction, seed=cfg.seed)
    if val is not None and hasattr(val, "__len__") and len(val) == 0:
        val = None
    label_free = teacher is not None and cfg.distill == 1
    if val is not None:
        val = TeacherLabelled(val, teacher if label_free else None, device, missing=_NEEDS_LABELS)
    lams = [m.lam for m in qcfs_sites(gm).values()]
    opt = make_optimizer(gm, cfg.optimizer, cfg.lr, weight_decay=cfg.weight_decay,
                         momentum=cfg.momentum, threshold_lr=cfg.lambda_lr, threshold_params=lams)
    steps = cfg.epochs * max(1, len(train)) if hasattr(train, "__len__") else None
    if cfg.max_steps is not None:
        steps = cfg.max_steps if steps is None else min(steps, cfg.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) if steps else 1.0)
    history = []
    best = (-1.0, None)
    if val is not None:
        # the calibrated, untrained state is epoch 0: training can never return something worse
        gm.eval()
        best = (evaluate(gm, val, device), copy.deepcopy(gm.state_dict()))
        summary["calibrated_val_acc"] = best[0]
    best_epoch = 0
    total = 0
    torch.manual_seed(cfg.seed)
    for epoch in range(cfg.epochs):
        if cfg.max_steps is not None and total >= cfg.max_steps:
            break
        gm.train()
        loss_sum = n = correct = 0
        bar = progress_bar(bounded(train, where="the QCFS training loader"), total=_length(train),
                           desc=f"QCFS epoch {epoch + 1}/{cfg.epochs}", disable=not progress, leave=False)
        steps_done = 0
        for batch in bar:
            steps_done += 1
            total += 1
            x, y = split_batch(batch, where="training loader")
            if y is None and not label_free:
                raise DataError(_NEEDS_LABELS)
            x = x.to(device)
            soft, y = teacher_targets(teacher, x, y, cfg.distill_temperature, device)
            out = gm(x)
            loss = distillation_loss(out, y, soft, weight=cfg.distill, temperature=cfg.distill_temperature,
                                     label_smoothing=cfg.label_smoothing, where="the QCFS training loader")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                for lam in lams:
                    lam.clamp_(min=1e-3)
            loss_sum += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
            bar.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{100 * correct / n:.1f}")
            if cfg.max_steps is not None and total >= cfg.max_steps:
                break
        gm.eval()
        record = {"epoch": epoch + 1, "loss": loss_sum / max(n, 1), "train_acc": 100.0 * correct / max(n, 1),
                  "steps": steps_done}
        if val is not None:
            record["val_acc"] = evaluate(gm, val, device)
            if record["val_acc"] > best[0]:
                best = (record["val_acc"], copy.deepcopy(gm.state_dict()))
                best_epoch = epoch + 1
        history.append(record)
    if best[1] is not None:
        gm.load_state_dict(best[1])
        summary["best_epoch"] = best_epoch
    gm.eval()
    return history


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def calibrate_qcfs(
    model: nn.Module,
    loader: Iterable,
    *,
    L: int = 8,
    percentile: float = 99.9,
    per_channel: bool = False,
    num_batches: int = 10,
    maxpool: str = "error",
    train: QCFSTrainConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    teacher: nn.Module | None = None,
    reset: str = "subtract",
) -> fx.GraphModule:
    """Replace every ReLU call site of a BatchNorm-free ``model`` with its own calibrated QCFS.

    lambda starts at the ``percentile`` of each site's pre-activation over ``num_batches`` batches
    (per layer, or per channel), then ``train`` optionally runs QCFS-aware training (labels
    needed unless ``train.distill`` is 1; validation split from ``loader``). ``teacher`` (an ANN
    mapping the same inputs to the same classes, used on a copy in eval mode) is required
    exactly when ``train.distill > 0``. ``reset="zero"``: every site computes the hard-reset
    neuron's rate over L steps (:func:`hard_reset_rate`) instead of QCFS, so that training
    teaches the function a hard-reset SNN computes. Works on a copy; returns a GraphModule whose
    ``meta["qcfs"]`` records lambda per site and the training history.

    Raises:
        BatchNormRemainsError: the model still holds BatchNorm (fold it first).
        UnsupportedLayerError: another activation (GELU, SiLU, ...), or max-pooling without
            ``maxpool="avg"``.
        DataError: empty loader, NaN/inf data, or training without labels (and ``distill < 1``).
        ConfigError: a teacher without ``train.distill > 0``, or the other way round.
    """
    distill = train.distill if train is not None and train.epochs > 0 else 0.0
    if (teacher is None) != (distill == 0):
        raise ConfigError("QCFS distillation needs both a teacher and train.distill > 0 (with epochs >= 1); "
                          f"got teacher={type(teacher).__name__ if teacher is not None else None} "
                          f"and distill={distill}")
    if teacher is not None and not isinstance(teacher, nn.Module):
        raise ConfigError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
    if maxpool not in ("error", "avg"):
        raise ConfigError(f"maxpool must be 'error' or 'avg', got {maxpool!r}")
    if reset not in ("subtract", "zero"):
        raise ConfigError(f"reset must be 'subtract' or 'zero', got {reset!r}")
    if not 0 < percentile <= 100:
        raise ConfigError(f"percentile must be in (0, 100], got {percentile}")
    if isinstance(L, bool) or int(L) != L or L < 1:
        raise ConfigError(f"L (QCFS quantisation levels) must be an integer >= 1, got {L!r}")
    if isinstance(num_batches, bool) or int(num_batches) != num_batches or num_batches < 1:
        raise ConfigError(f"num_batches must be an integer >= 1, got {num_batches!r}")
    device = torch.device(device)
    gm = prepare(model, leaf_types=(QCFS,))
    assert_no_batchnorm(gm, stage="before QCFS calibration")
    check_activations(gm, maxpool)
    pooled = _replace_maxpool(gm) if maxpool == "avg" else []
    gm.recompile()
    gm.to(device)
    sites = relu_sites(gm)
    ndims: dict[str, int] = {}
    lams = _percentiles(gm, loader, sites, percentile=percentile, per_channel=per_channel,
                        num_batches=num_batches, device=device, progress=progress, ndims=ndims,
                        hard_reset_steps=L if reset == "zero" else None)
    used: set[str] = set(n for n, _ in gm.named_modules())
    record: dict[str, Any] = {"sites": {}, "maxpool_replaced": pooled, "reset": reset}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sites:
        name = _site_name(node, used)
        src = _relu_input(node)
        inplace = _is_inplace(gm, node)
        cap = getattr(module_of(gm, node), "cap", None)  # a clipped ReLU (snnconv.clip)
        if cap is not None:
            lams[node.name] = lams[node.name].clamp(max=cap)
        site = QCFS(L, lams[node.name], reset=reset).to(device)
        # the rank of the site's input (not saved): IF replacement needs it to scale a Linear
        # that reads this site's output on the right dimension
        site.input_ndim = ndims.get(node.name)
        gm.add_submodule(name, site)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (src,))
        node.replace_all_uses_with(new)
        if inplace and isinstance(src, fx.Node):
            # an in-place ReLU also rewrote its input: later readers of it saw the activation
            for user in list(src.users):
                if user is not new and order.get(user, -1) > order[node]:
                    user.replace_input_with(src, new)
        gm.graph.erase_node(node)
        record["sites"][name] = {"replaces": describe_node(node), "lambda_init": lams[node.name].tolist()}
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    if train is not None and train.epochs > 0:
        if teacher is not None:
            teacher = copy.deepcopy(teacher).to(device).eval().requires_grad_(False)
        record["history"] = _train_qcfs(gm, loader, train, device, progress, record, teacher)
    for name, q in qcfs_sites(gm).items():
        site = record["sites"].setdefault(name, {"replaces": "an existing QCFS module (kept)"})
        site["lambda"] = q.lam.detach().cpu().tolist()
    gm.meta["qcfs"] = record
    return gm
