"""Invariants checked between stages. BatchNorm first of all."""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from snnconv.errors import BatchNormRemainsError, UnsupportedModelError
from snnconv.graph import describe_node, trace

__all__ = ["find_batchnorm", "assert_no_batchnorm", "functional_batchnorm_calls"]

#: Call targets that compute a batch norm inside a traced graph.
FUNCTIONAL_BATCHNORM = {F.batch_norm, torch.batch_norm, torch.native_batch_norm,
                  torch.ops.aten.batch_norm.default,
                  torch.ops.aten._native_batch_norm_legit_no_training.default}


def functional_batchnorm_calls(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """One ``"where: what"`` string per functional ``batch_norm`` call in ``gm``'s own graph."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in FUNCTIONAL_BATCHNORM:
            found.append(f"{prefix}{describe_node(node)}: functional batch_norm")
        elif node.op == "call_method" and node.target == "batch_norm":
            found.append(f"{prefix}{describe_node(node)}: Tensor.batch_norm")
    return found


def find_batchnorm(model: nn.Module, *, trace_graph: bool = True) -> list[str]:
    """List every BatchNorm in ``model``: ``_BatchNorm`` modules and functional calls.

    Modules are found by walking ``named_modules()`` (nested containers included); functional
    ``batch_norm`` calls by reading the fx graph (the model's own if it is a GraphModule, every
    nested GraphModule, else a fresh trace). A model fx cannot trace is checked for modules only,
    with a warning.
    """
    found = []
    graphs: list[tuple[str, fx.GraphModule]] = []
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            found.append(f"module '{name or '<root>'}': {type(module).__name__}")
        if isinstance(module, fx.GraphModule):
            graphs.append((name, module))
    if trace_graph:
        if not graphs:
            try:
                graphs.append(("", trace(model)))
            except UnsupportedModelError as exc:
                warnings.warn(f"functional batch_norm calls were not checked: {exc}", stacklevel=2)
        for name, gm in graphs:
            found.extend(functional_batchnorm_calls(gm, f"in '{name}' " if name else ""))
    return found


def assert_no_batchnorm(model: nn.Module, *, stage: str | None = None) -> None:
    """Raise :class:`BatchNormRemainsError` listing every BatchNorm left in ``model``.

    Args:
        model: any module (a GraphModule is read as is; other modules are traced).
        stage: the pipeline stage after which the check runs, quoted in the message.
    """
    offenders = find_batchnorm(model)
    if offenders:
        after = f" after stage '{stage}'" if stage else ""
        listing = "\n  - ".join(offenders)
        raise BatchNormRemainsError(
            f"{len(offenders)} BatchNorm(s) remain{after}:\n  - {listing}\n"
            "Fold them with snnconv.fold_batchnorm(model) (a BatchNorm must directly follow a "
            "Conv/Linear layer to fold), or remove them before converting.",
            offenders,
        )
