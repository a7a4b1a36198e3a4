"""The `prepare` stage's rewrites: the constructs (:mod:`snnconv.constructs`) given their IF form.

Each is a pass of its own module (pattern as data, in place on the caller's copy, a report):
clipped ReLUs become capped ReLU sites (:mod:`snnconv.constructs.clip`), spatial means become average
pooling (:mod:`snnconv.constructs.means`), an adaptive pool that replicates or has uneven windows folds
into its Linear and an idle ``ceil_mode`` is dropped (:mod:`snnconv.constructs.pools`; a ``ceil_mode``
that adds a window is written as a convolution and a scale after the QCFS stage, where
max-pooling has become average pooling), channel shuffles and chunks become one-hot 1x1
convolutions (:mod:`snnconv.constructs.channels`) and, with ``maxpool="auto"``, the static analog prefix
moves into one module (:mod:`snnconv.constructs.prefix`; its BatchNorms folded there). BatchNorms that no
convolution precedes are handled by the fold stage (:mod:`snnconv.constructs.affine`).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from snnconv.config import MAXPOOL_MODES
from snnconv.constructs.channels import rewrite_channel_moves
from snnconv.constructs.clip import rewrite_clips
from snnconv.constructs.means import rewrite_means
from snnconv.constructs.pools import drop_idle_ceil_mode, fold_adaptive_pools
from snnconv.constructs.prefix import PREFIX_NAME, split_prefix
from snnconv.stages.fold import fold_graph

__all__ = ["rewrite_constructs"]



def rewrite_constructs(gm: fx.GraphModule, example_inputs: tuple, *, maxpool: str = "auto") -> dict[str, Any]:
    """Run the rewrites on ``gm`` in place; return what each changed and why."""
    if maxpool not in MAXPOOL_MODES:
        raise ValueError(f"maxpool must be one of {MAXPOOL_MODES}, got {maxpool!r}")
    report: dict[str, Any] = {"clips": [c.to_dict() for c in rewrite_clips(gm)],
                              "means": rewrite_means(gm, example_inputs),
                              "adaptive_pools": fold_adaptive_pools(gm, example_inputs),
                              "ceil_mode_dropped": drop_idle_ceil_mode(gm, example_inputs),
                              "channel_moves": rewrite_channel_moves(gm, example_inputs)}
    if maxpool == "auto":
        prefix = split_prefix(gm)
        if prefix["nodes"]:
            inner = gm.get_submodule(PREFIX_NAME).net
            assert isinstance(inner, fx.GraphModule)
            prefix["folded"] = [p.to_dict() for p in fold_graph(inner, example_inputs)]
        report["prefix"] = prefix
    return report
