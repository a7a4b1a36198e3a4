"""What every calibration reads from its data and from the QCFS-ANN it calibrates against:
the calibration batches (:func:`snnconv.data.calibration_batches`, importable from here), the
reference's QCFS sites, and their per-channel mean outputs."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.fx as fx

from snnconv.activation import QCFS
from snnconv.data import calibration_batches
from snnconv.graph import capture_pieces, module_of, set_module

__all__ = ["calibration_batches", "reference_sites", "qcfs_levels", "reference_means", "channel_sums",
           "channel_mean", "ReLUSite", "unquantised"]


def reference_sites(ref: fx.GraphModule) -> dict[str, str]:
    """The QCFS sites of the traced reference ``ref``: module name -> fx node name."""
    return {str(n.target): n.name for n in ref.graph.nodes
            if n.op == "call_module" and isinstance(module_of(ref, n), QCFS)}


def channel_sums(v: torch.Tensor) -> torch.Tensor:
    """Per channel (dim 1), the sum of ``v`` in float64: each image's positions summed in
    float32 first (a contiguous reduction; no float64 copy of ``v``)."""
    if v.dim() > 2:
        v = v.reshape(v.shape[0], v.shape[1], -1).sum(2)
    return v.double().sum(0)


def channel_mean(v: torch.Tensor) -> torch.Tensor:
    """Per channel (dim 1), the mean of ``v`` in float64 (see :func:`channel_sums`)."""
    return channel_sums(v) / (v.numel() // v.shape[1])


@contextlib.contextmanager
def qcfs_levels(ref: fx.GraphModule, levels: int | None):
    """Every QCFS of ``ref`` at ``levels`` quantisation steps inside (``None``: as it is); a
    hard-reset site (``hard_T``) at the rate over ``levels`` steps."""
    mods = [m for n in ref.graph.nodes if n.op == "call_module" and isinstance(m := module_of(ref, n), QCFS)]
    old = [(m.L, m.hard_T) for m in mods]
    if levels:
        for m in mods:
            m.L = int(levels)
            m.hard_T = None if m.hard_T is None else int(levels)
    try:
        yield
    finally:
        for m, (L, hard_T) in zip(mods, old):
            m.L, m.hard_T = L, hard_T


def reference_means(ref: fx.GraphModule, ref_nodes: dict, batches: list, levels: int | None) -> dict:
    """Per QCFS site of ``ref``: its per-channel mean output over ``batches``, with every QCFS
    at ``levels`` quantisation steps (``None``: as it is)."""
    means: dict[str, torch.Tensor] = {}
    with qcfs_levels(ref, levels):
        for x in batches:
            # in pieces of images where the batch's forward does not fit: their means weighted
            for lo, hi, values in capture_pieces(ref, x, ref_nodes.values(), reduce=channel_mean):
                for target, name in ref_nodes.items():
                    mean = values[name] * ((hi - lo) / len(x))
                    means[target] = means.get(target, 0) + mean / len(batches)
    return means


class ReLUSite(QCFS):
    """A QCFS site that computes the ANN's ReLU (no clip, no quantisation; its ``lam`` and
    ``L`` are kept, unused): the calibrations' reference ``"ann"``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def unquantised(qgm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the QCFS-ANN ``qgm`` with a :class:`ReLUSite` at every QCFS site: the ANN with
    ``qgm``'s weights, its sites under the same names."""
    out = copy.deepcopy(qgm)
    for name, m in list(out.named_modules()):
        if type(m) is QCFS:
            site = ReLUSite(m.L, m.lam.detach(), m.phi).to(m.lam.device)
            site.input_ndim = getattr(m, "input_ndim", None)  # type: ignore[assignment]
            set_module(out, name, site)
    return out
