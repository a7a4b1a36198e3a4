"""The `fold` stage: fold every BatchNorm into the convolution or linear layer that feeds it.

Three layers, as in torch's own FX passes: tensor math (:func:`fold_weights`), a module
constructor (:func:`folded_producer`), and a graph pass (:func:`fold_batchnorm`) that only
rewires nodes. Matching is done on the fx graph (``node.args``, ``node.users``).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from snnconv.constructs.affine import fold_into_consumer, replace_with_affine
from snnconv.errors import FoldError
from snnconv.graph import call_counts, capture, describe_node, module_of, prepare, set_module
from snnconv.guards import functional_batchnorm_calls

__all__ = ["FoldedPair", "fold_weights", "folded_producer", "fold_batchnorm", "fold_graph"]

#: Layers a BatchNorm can be folded into.
PRODUCERS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

#: Rank of a producer's batched output whose dim 1 holds its output channels (what BN normalises).
_OUTPUT_RANK: tuple[tuple[type[nn.Module], int], ...] = (
    (nn.Conv1d, 3), (nn.Conv2d, 4), (nn.Conv3d, 5), (nn.Linear, 2))

_ADDS = {operator.add, torch.add, operator.iadd}


@dataclass
class FoldedPair:
    """One fold: the producers that absorbed ``batchnorm`` and the error it introduced."""

    batchnorm: str
    producers: list[str]
    max_abs_diff: float | None = None
    #: "producer" (into the layer before), "consumer" (into the unpadded layer after) or
    #: "affine" (an explicit per-channel affine layer where the BatchNorm was: snnconv.constructs.affine)
    kind: str = "producer"
    why: str = ""

    def to_dict(self) -> dict:
        out = {"batchnorm": self.batchnorm, "producers": list(self.producers),
               "max_abs_diff": self.max_abs_diff, "kind": self.kind}
        if self.why:
            out["why"] = self.why
        return out


def fold_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    add_shift: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold BN statistics into a producer's weight (output channels on dim 0) and bias.

    .. math::
        s = \\gamma / \\sqrt{\\sigma^2 + \\epsilon}, \\quad W' = s W, \\quad
        b' = s (b - \\mu) + \\beta

    Computed in float64 and cast back to the weight's dtype. With ``add_shift=False`` the
    ``-s mu + beta`` shift is left out (used when several addends share one BatchNorm and
    only one of them carries the shift).
    """
    dtype = weight.dtype
    w = weight.detach().double()
    out = w.shape[0]
    b = (bias.detach().double() if bias is not None
         else torch.zeros(out, dtype=torch.float64, device=w.device))
    mean = running_mean.detach().double()
    var = running_var.detach().double()
    g = gamma.detach().double() if gamma is not None else torch.ones_like(mean)
    bt = beta.detach().double() if beta is not None else torch.zeros_like(mean)
    scale = g / torch.sqrt(var + eps)
    w_new = w * scale.reshape((-1,) + (1,) * (w.dim() - 1))
    if add_shift:
        b_new = (b - mean) * scale + bt
    else:
        b_new = b * scale
    return w_new.to(dtype), b_new.to(dtype)


def folded_producer(producer: Any, bn: Any, *, add_shift: bool = True) -> nn.Module:
    """A new producer (a copy; the inputs are untouched) computing ``bn(producer(x))``.

    The new weight and bias are trainable parameters (``requires_grad=True``).
    """
    w, b = fold_weights(
        producer.weight, producer.bias, bn.running_mean, bn.running_var, bn.eps,
        bn.weight if bn.affine else None, bn.bias if bn.affine else None, add_shift=add_shift,
    )
    new = copy.deepcopy(producer)
    new.weight = nn.Parameter(w, requires_grad=True)
    new.bias = nn.Parameter(b, requires_grad=True)
    return new


def _bn_problem(bn: _BatchNorm) -> str | None:
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return ("it has no running statistics (track_running_stats=False), so it normalises "
                "with each batch's own statistics and is not an affine map; retrain it with "
                "track_running_stats=True or remove it")
    return None


def _rank_problem(name: str, producer: nn.Module, bn: _BatchNorm, rank: int | None) -> str | None:
    """Why ``bn`` does not normalise ``producer``'s output channels (None when it does).

    BatchNorm normalises dim 1; a producer's output channels are on dim 1 only for a batched
    output (a Linear's features are on its last dim, so only a 2-d Linear output qualifies).
    ``rank`` is the output rank seen on an example batch, None when unknown.
    """
    expected = next(r for t, r in _OUTPUT_RANK if isinstance(producer, t))
    kind = type(producer).__name__
    if rank is not None and rank != expected:
        return (f"its producer '{name}' ({kind}) gives a {rank}-d output here, so the BatchNorm "
                f"normalises dim 1, which is not the {kind}'s output channels (that needs a "
                f"{expected}-d output); folding would change the function")
    if rank is None and isinstance(producer, nn.Linear) and isinstance(bn, (nn.BatchNorm2d, nn.BatchNorm3d)):
        return (f"its producer '{name}' is a Linear, whose features are on the last dim, but "
                f"{type(bn).__name__} normalises dim 1 of a {4 if isinstance(bn, nn.BatchNorm2d) else 5}-d "
                "tensor; folding would change the function")
    return None


def _producer_problem(gm: fx.GraphModule, bn_node: fx.Node, src: fx.Node, bn: _BatchNorm,
                      rank: int | None = None) -> str | None:
    """Why ``src`` cannot absorb ``bn`` (None when it can); ``rank``: output rank if known."""
    if src.op == "placeholder":
        return (f"it is applied to the model input '{src.name}', with no layer before it to "
                "absorb it; keep it as an explicit affine preprocessing step outside the model")
    producer = module_of(gm, src)
    if not isinstance(producer, PRODUCERS):
        what = (f"{type(producer).__name__} (fx node '{src.name}')" if producer is not None
                else describe_node(src))
        return (f"it is fed by {what}, not by a Conv1d/2d/3d or Linear; "
                "folding across an activation, pooling or concatenation would change the "
                "function. Move the BatchNorm directly after a convolution or linear layer")
    if len(src.users) > 1:
        others = ", ".join(u.name for u in src.users if u is not bn_node)
        return (f"its producer '{src.target}' also feeds {others}; folding would change what "
                "those users see. Give the BatchNorm its own producer")
    sites = sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == src.target)
    if sites > 1:
        return (f"its producer '{src.target}' is called at {sites} places in forward(); folding "
                "would change the other calls. Use one module per call site")
    channels = cast(torch.Tensor, producer.weight).shape[0]
    if channels != bn.num_features:
        return (f"its producer '{src.target}' has {channels} output channels but "
                f"the BatchNorm normalises {bn.num_features}")
    return _rank_problem(str(src.target), producer, bn, rank)


def _no_producer(gm: fx.GraphModule, src: fx.Node) -> bool:
    """Whether ``src`` is no layer a BatchNorm can fold into (the input, an activation, a
    concatenation, a layer with other users or call sites): the BatchNorm is then an affine map
    of its own (:mod:`snnconv.constructs.affine`)."""
    if src.op == "placeholder" or not isinstance(module_of(gm, src), PRODUCERS):
        return True
    return len(src.users) > 1 or call_counts(gm).get(str(src.target), 0) > 1


def _as_affine(gm: fx.GraphModule, bn_node: fx.Node, rank: int | None, why: str) -> FoldedPair:
    """Fold ``bn_node`` into its consumer where exact, else make it an explicit affine layer."""
    name = str(bn_node.target)
    consumer = fold_into_consumer(gm, bn_node, rank, call_counts(gm))
    if consumer is None:
        replace_with_affine(gm, bn_node, rank)
        return FoldedPair(name, [name], kind="affine", why=why)
    bn_node.replace_all_uses_with(cast(fx.Node, bn_node.args[0]))
    gm.graph.erase_node(bn_node)
    return FoldedPair(name, [consumer], kind="consumer", why=why)


def _fold_one(gm: fx.GraphModule, bn_node: fx.Node, rank: int | None = None) -> FoldedPair:
    bn = cast(_BatchNorm, module_of(gm, bn_node))  # the caller found a BatchNorm node
    name = str(bn_node.target)
    problem = _bn_problem(bn)
    if problem is not None:
        raise FoldError(f"cannot fold BatchNorm '{name}' ({type(bn).__name__}): {problem}.")
    src = bn_node.args[0]
    if not isinstance(src, fx.Node):
        raise FoldError(f"cannot fold BatchNorm '{name}': its input is a constant, not a layer output.")

    # Stretch case: BN(p1(x) + p2(y) + ...) folds into every addend.
    if src.op == "call_function" and src.target in _ADDS and len(src.users) == 1:
        addends = [a for a in src.args if isinstance(a, fx.Node)]
        if len(addends) == len(src.args) and not src.kwargs:
            if len(set(addends)) < len(addends):
                raise FoldError(f"cannot fold BatchNorm '{name}' after an add: the add sums the same "
                                f"value '{addends[0].name}' more than once, so no single producer "
                                "can absorb it. Write the sum as one layer (e.g. scale the weights) "
                                "or give each addend its own producer.")
            problems = [_producer_problem(gm, src, a, bn, rank) for a in addends]
            if all(p is None for p in problems):
                for i, a in enumerate(addends):
                    new = folded_producer(module_of(gm, a), bn, add_shift=(i == 0))
                    set_module(gm, str(a.target), new)
                bn_node.replace_all_uses_with(src)
                gm.graph.erase_node(bn_node)
                return FoldedPair(name, [str(a.target) for a in addends])
            reason = next(p for p in problems if p is not None)
            return _as_affine(gm, bn_node, rank, f"after an add, one addend cannot absorb it: {reason}")

    problem = _producer_problem(gm, bn_node, src, bn, rank)
    if problem is not None and not _no_producer(gm, src):
        raise FoldError(f"cannot fold BatchNorm '{name}' ({type(bn).__name__}): {problem}.")
    if problem is not None:
        return _as_affine(gm, bn_node, rank, problem)
    set_module(gm, str(src.target), folded_producer(module_of(gm, src), bn))
    bn_node.replace_all_uses_with(src)
    gm.graph.erase_node(bn_node)
    return FoldedPair(name, [str(src.target)])


def fold_graph(gm: fx.GraphModule, example_inputs: tuple | None = None) -> list[FoldedPair]:
    """Fold every BatchNorm of the traced ``gm`` in place; return what was folded.

    With ``example_inputs``, each pair records the max abs difference between the original
    BatchNorm output and the folded producer output on that batch.

    Raises:
        FoldError: a BatchNorm (module or functional) that cannot be folded; names it and why.
    """
    functional = functional_batchnorm_calls(gm)
    if functional:
        raise FoldError(
            f"cannot fold the functional batch_norm call(s) {'; '.join(functional)}: snnconv folds "
            "BatchNorm modules only. Replace F.batch_norm with an nn.BatchNorm module "
            "directly after its convolution or linear layer.")
    bn_nodes = [n for n in gm.graph.nodes
                if n.op == "call_module" and isinstance(module_of(gm, n), _BatchNorm)]
    reference = None
    if example_inputs is not None and bn_nodes:
        reference = capture(gm, example_inputs, [n.name for n in bn_nodes])
    pairs = []
    sources = {}
    for bn_node in bn_nodes:
        bn_name, src = bn_node.name, bn_node.args[0]
        rank = reference[bn_name].dim() if reference is not None else None
        pair = _fold_one(gm, bn_node, rank)
        pairs.append(pair)
        # _fold_one refused an input that is not a node; an affine layer keeps the node's name
        sources[bn_name] = {"producer": src.name, "affine": bn_name}.get(pair.kind)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    if reference is not None and example_inputs is not None:
        folded = capture(gm, example_inputs, [v for v in sources.values() if v])
        for pair, (bn_name, src_name) in zip(pairs, sources.items()):
            if src_name is None:  # folded into its consumer: checked by the end-to-end diff
                continue
            diff = (folded[src_name].double() - reference[bn_name].double()).abs().max()
            pair.max_abs_diff = float(diff)
    return pairs


def fold_batchnorm(model: nn.Module, example_input: torch.Tensor | None = None) -> fx.GraphModule:
    """Return a copy of ``model`` with every BatchNorm folded into its producer.

    The copy computes the same function (in eval mode, running statistics) with no BatchNorm
    left; the caller's model is not changed. A model without BatchNorm comes back unchanged.
    Without ``example_input`` a Linear -> BatchNorm1d pair is assumed to see a 2-d
    ``[batch, features]`` tensor; with it, every pair's output rank is checked.

    Args:
        model: a traceable ``nn.Module``.
        example_input: optional batch; when given, ``result.meta["folded"]`` records the max abs
            difference each fold introduced on it.

    Returns:
        A ``torch.fx.GraphModule`` in eval mode; ``.meta["folded"]`` lists the folded pairs.

    Raises:
        FoldError: a BatchNorm without running statistics, fed by something that is not a
            single-use Conv/Linear (an activation, an add, a concat, the input), applied to
            a dim that is not the producer's output channels (a 3-d Linear output), or
            functional.
        UnsupportedModelError: torch.fx cannot trace the model.
    """
    gm = prepare(model)
    example = (example_input,) if example_input is not None else None
    pairs = fold_graph(gm, example)
    gm.meta["folded"] = [p.to_dict() for p in pairs]
    return gm
