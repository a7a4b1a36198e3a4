"""A clipped ReLU (``ReLU6``, ``Hardtanh(0, a)``, ``clamp(x, 0, a)``) as a capped ReLU site.

An IF neuron emits at most one spike per step, so its rate is a clip at its threshold, and so is
QCFS at lambda. A ReLU clipped at ``a`` is therefore a ReLU site whose QCFS lambda (and IF
threshold) is at most ``a``: QCFS calibration caps lambda at :attr:`CappedReLU.cap`, and the
network needs no retraining. The pass rewrites the call sites on the traced graph, on a copy's
graph in place, and returns what it changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.graph import describe_node, module_of

__all__ = ["CappedReLU", "rewrite_clips", "clip_bounds"]


class CappedReLU(nn.ReLU):
    """``min(max(x, 0), cap)``: a ReLU site whose QCFS lambda is capped at ``cap``."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = float(cap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, 0.0, self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


#: Pattern as data: call target -> (position, keyword, default) of the lower and upper bound.
_FUNCTION_BOUNDS: dict[Any, tuple[tuple[int, str, float | None], tuple[int, str, float | None]]] = {
    F.relu6: ((-1, "", 0.0), (-1, "", 6.0)),
    F.hardtanh: ((1, "min_val", -1.0), (2, "max_val", 1.0)),
    F.hardtanh_: ((1, "min_val", -1.0), (2, "max_val", 1.0)),
    torch.clamp: ((1, "min", None), (2, "max", None)),
    torch.clip: ((1, "min", None), (2, "max", None)),
}
_METHOD_BOUNDS: dict[Any, tuple[tuple[int, str, float | None], tuple[int, str, float | None]]] = {
    m: _FUNCTION_BOUNDS[torch.clamp] for m in ("clamp", "clip", "clamp_", "clip_")}


def _arg(node: fx.Node, pos: int, key: str, default: Any) -> Any:
    if pos < 0:
        return default
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def clip_bounds(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, Any] | None:
    """``(low, high)`` of a clip call site (``nn.Hardtanh``/``ReLU6``, ``F.hardtanh``,
    ``F.relu6``, ``clamp``/``clip``), else None."""
    mod = module_of(gm, node)
    if isinstance(mod, nn.Hardtanh):  # nn.ReLU6 is a Hardtanh(0, 6)
        return mod.min_val, mod.max_val
    table = (_FUNCTION_BOUNDS.get(node.target) if node.op == "call_function"
             else _METHOD_BOUNDS.get(node.target) if node.op == "call_method" else None)
    if table is None:
        return None
    return tuple(_arg(node, *spec) for spec in table)


@dataclass
class ClipRewrite:
    """One clip call site made a capped ReLU."""

    site: str
    cap: float
    module: str

    def to_dict(self) -> dict:
        return {"site": self.site, "cap": self.cap, "module": self.module}


def rewrite_clips(gm: fx.GraphModule) -> list[ClipRewrite]:
    """Replace every clip at ``[0, a]`` (``a > 0`` a constant) in ``gm`` by a :class:`CappedReLU`.

    Edits ``gm`` in place (give it a copy) and recompiles it. Clips with another lower bound
    (``Hardtanh(-1, 1)``) or a bound that is a tensor are left alone: the activation check refuses
    them by name.
    """
    done = []
    used = {n for n, _ in gm.named_modules()}
    for node in list(gm.graph.nodes):
        bounds = clip_bounds(gm, node)
        if bounds is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        low, high = bounds
        if not (isinstance(low, (int, float)) and isinstance(high, (int, float))):
            continue
        if float(low) != 0.0 or not float(high) > 0.0:
            continue
        name, k = f"capped_{node.name}", 1
        while name in used:
            name, k = f"capped_{node.name}_{k}", k + 1
        used.add(name)
        gm.add_submodule(name, CappedReLU(float(high)))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(new)
        src = node.args[0]
        inplace = bool(getattr(module_of(gm, node), "inplace", False)) or node.target in (
            F.hardtanh_, "clamp_", "clip_") or node.kwargs.get("inplace", False)
        if inplace:  # later readers of the overwritten input saw the clipped value
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            for user in list(src.users):
                if user is not new and order[user] > order[node]:
                    user.replace_input_with(src, new)
        done.append(ClipRewrite(describe_node(node), float(high), name))
        gm.graph.erase_node(node)
    if done:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done

