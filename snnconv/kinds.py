"""Layer kinds: what each module kind means from conversion to the chip, one record each.

A :class:`LayerKind` says how the conversion takes a module (:attr:`LayerKind.role`), how a
network file saves it (:attr:`LayerKind.saved`: its constructor keywords), and what NIR makes of
it (:attr:`LayerKind.nir`: the op kinds of :data:`snnconv.nir.ops.OPS` it is written as and read
back as, or why NIR cannot express it). Every table keyed by module kind is derived from
:data:`KINDS`: the modules the activation checks accept (:data:`ACCEPTED_MODULES`), the network
file's module table (:data:`SAVED`), the export's refusals (:data:`NO_NIR_FORM`); the export's
writers and the executors' tables are keyed by the names and op kinds here, and
``tests/test_op_vocabulary.py`` walks every record through convert, save, load, export and the
cpu backend (or the refusal by name). Adding a module kind is adding a record here, then its
writer (``snnconv.snn.nir_io.WRITERS``) where it has a NIR form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from snnconv.snn.neuron import IFNeuron, Scale, TimeExpand

__all__ = ["LayerKind", "KINDS", "ROLES", "kind_of", "ACCEPTED_MODULES", "SAVED", "NO_NIR_FORM"]

#: How the conversion takes a module kind.
ROLES = {
    "between": "between neurons: a linear map, a rearrangement or an identity at inference, kept",
    "replaced": "replaced by the conversion (ReLU: an IF neuron; BatchNorm: folded into its layer)",
    "prefix": "in the analog prefix only (max-pooling at the stem), run once per image before time",
    "spiking": "made by the conversion (neurons, their output scale, time expansion)",
}


@dataclass(frozen=True)
class LayerKind:
    """One module kind.

    Attributes:
        name: the kind's name (the export's writers are keyed by it).
        modules: the torch module types of this kind.
        role: a key of :data:`ROLES`.
        saved: the module's constructor keywords in a network file (``SpikingNetwork.save``);
            None: it never reaches a converted network (a replaced kind).
        nir: the op kinds it is written as and read back as; ``()`` with ``no_nir`` None: the
            export passes its input on (an identity at inference, the analog prefix's parts).
        no_nir: why NIR cannot express it (the export refuses it by name before writing).
    """

    name: str
    modules: tuple[type, ...]
    role: str
    saved: Callable[[Any], dict] | None
    nir: tuple[str, ...] = ()
    no_nir: str | None = None


def _conv(m: Any) -> dict:
    return dict(in_channels=m.in_channels, out_channels=m.out_channels, kernel_size=m.kernel_size,
                stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups,
                bias=m.bias is not None, padding_mode=m.padding_mode)


def _conv_transpose(m: Any) -> dict:
    return dict(_conv(m), output_padding=m.output_padding)


def _avgpool(m: Any) -> dict:
    cfg = dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding,
               ceil_mode=m.ceil_mode, count_include_pad=m.count_include_pad)
    if hasattr(m, "divisor_override"):
        cfg["divisor_override"] = m.divisor_override
    return cfg


def _output_size(m: Any) -> dict:
    return dict(output_size=m.output_size)


def _if_neuron(m: Any) -> dict:
    # tensors are stored beside the config: here only their shapes
    return dict(theta=torch.ones(m.theta.shape), T=m.T, alpha=m.alpha, detach_reset=m.detach_reset,
                reset=m.reset, v_init=torch.zeros(m.v_init.shape) if m.reset == "subtract" else None,
                burst=m.burst)


_NO_2D_POOL = "NIR pools in 2-d only"
_NO_PAD = "NIR has no padding node (give the padding to the convolution that follows)"

#: Every module kind, in the order the export matches them (the first whose types match).
KINDS: tuple[LayerKind, ...] = (
    LayerKind("conv", (nn.Conv1d, nn.Conv2d), "between", _conv, nir=("conv1d", "conv2d")),
    LayerKind("conv3d", (nn.Conv3d,), "between", _conv, no_nir="NIR has no 3-d convolution"),
    LayerKind("conv_transpose", (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "between",
              _conv_transpose, no_nir="NIR has no transposed convolution"),
    LayerKind("linear", (nn.Linear,), "between",
              lambda m: dict(in_features=m.in_features, out_features=m.out_features, bias=m.bias is not None),
              nir=("affine", "linear")),
    LayerKind("avgpool2d", (nn.AvgPool2d,), "between", _avgpool, nir=("avgpool2d", "sumpool2d")),
    LayerKind("avgpool", (nn.AvgPool1d, nn.AvgPool3d), "between", _avgpool, no_nir=_NO_2D_POOL),
    LayerKind("adaptive_avgpool2d", (nn.AdaptiveAvgPool2d,), "between", _output_size, nir=("avgpool2d",)),
    LayerKind("adaptive_avgpool", (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d), "between", _output_size,
              no_nir=_NO_2D_POOL),
    LayerKind("flatten", (nn.Flatten,), "between", lambda m: dict(start_dim=m.start_dim, end_dim=m.end_dim),
              nir=("flatten",)),
    LayerKind("unflatten", (nn.Unflatten,), "between",
              lambda m: dict(dim=m.dim, unflattened_size=tuple(m.unflattened_size)),
              no_nir="NIR has no reshape node"),
    LayerKind("zero_pad", (nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d), "between", lambda m: dict(padding=m.padding),
              no_nir=_NO_PAD),
    LayerKind("dropout", (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), "between",
              lambda m: dict(p=m.p)),
    LayerKind("identity", (nn.Identity,), "between", lambda m: {}),
    LayerKind("relu", (nn.ReLU,), "replaced", lambda m: {}),  # saved where it runs in the analog prefix
    LayerKind("batchnorm", (nn.modules.batchnorm._BatchNorm,), "replaced", None),
    LayerKind("maxpool", (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), "prefix",
              lambda m: dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                             ceil_mode=m.ceil_mode)),
    LayerKind("adaptive_maxpool", (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), "prefix",
              _output_size),
    LayerKind("if_neuron", (IFNeuron,), "spiking", _if_neuron, nir=("neuron",)),
    LayerKind("scale", (Scale,), "spiking", lambda m: dict(theta=torch.ones(m.theta.shape)), nir=("scale",)),
    LayerKind("time_expand", (TimeExpand,), "spiking", lambda m: dict(T=m.T)),
)


def kind_of(module_type: type) -> LayerKind | None:
    """The record of ``module_type`` (the first whose types it is, or subclasses), else None."""
    for kind in KINDS:
        if issubclass(module_type, kind.modules):
            return kind
    return None


#: The module kinds the activation checks accept in a network to convert.
ACCEPTED_MODULES: tuple[type, ...] = tuple(m for k in KINDS if k.role in ("between", "replaced") for m in k.modules)

#: A network file's module table: type name -> (type, its constructor keywords).
SAVED: dict[str, tuple[type, Callable[[Any], dict]]] = {
    m.__name__: (m, k.saved) for k in KINDS if k.saved is not None for m in k.modules}

#: Module kinds that convert but that NIR cannot express, and why (export refuses them by name).
NO_NIR_FORM: dict[type, str] = {m: k.no_nir for k in KINDS if k.no_nir for m in k.modules}
