"""The leaky neurons of the dense executor (NIR's ``LIF``, ``CubaLIF``, ``LI``): the step
functions of :mod:`snnconv.snn.neuron` over T steps, so that every executor means the same."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from snnconv.nir.leaky import leaky_params
from snnconv.snn.neuron import leaky_sequence

if TYPE_CHECKING:
    from snnconv_backends.engine.stats import Stats

__all__ = ["leaky_fn"]


def leaky_fn(op: Any, dtype: torch.dtype, device: torch.device) -> Callable:
    """``fn(u, T, static, stats) -> (out [T, b, ...], None)`` of a leaky op, its state in
    ``dtype``: spikes (``lif``, ``cubalif``) or membranes (``li``). ``u``: ``[T, b, ...]``, or,
    ``static``, ``[b, ...]`` presented at every step."""
    p = leaky_params(op.params).to(dtype, device)
    kind = op.kind

    def leaky(u: torch.Tensor, T: int, static: bool, stats: "Stats"):
        if u.dtype != dtype:
            u = u.to(dtype)
        return leaky_sequence(kind, [u] * T if static else u, p), None

    return leaky
