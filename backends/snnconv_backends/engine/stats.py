"""Statistics of a dense run: spike counts per neuron and step, synaptic operations per layer
(each spike times its structural fan-out, computed once per graph) and the ANN's MACs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from snnconv.analysis.energy import conv_macs, linear_macs
from snnconv.nir.leaky import SPIKING
from snnconv_backends.engine.ops import PASS, WEIGHTED, flatten_dims

if TYPE_CHECKING:
    from snnconv_backends.engine.bound import BoundGraph

__all__ = ["Stats", "fanouts", "folded", "macs_per_image"]


def folded(op: Any) -> bool:
    """A per-channel scale or a concatenation's placement: it carries each spike unchanged, and a
    weighted op after it takes it into its weights (as a chip does)."""
    return op.kind == "scale" or bool(op.params.get("placement"))


def _feeds_weighted(ops: list[Any]) -> set[str]:
    """Names of the folded ops whose output reaches a weighted op through pass-through ops: they
    are charged nothing; that op counts their spikes (:func:`_sources`)."""
    consumers: dict[str, list[Any]] = {}
    for op in ops:
        for i in op.inputs:
            consumers.setdefault(i, []).append(op)
    reaches: set[str] = set()
    for op in reversed(ops):  # consumers come later in topological order
        if folded(op) and any((c.kind in WEIGHTED and not folded(c)) or
                              ((c.kind in PASS or folded(c)) and c.name in reaches)
                              for c in consumers.get(op.name, ())):
            reaches.add(op.name)
        elif op.kind in PASS and any((c.kind in WEIGHTED and not folded(c)) or c.name in reaches
                                     for c in consumers.get(op.name, ())):
            reaches.add(op.name)
    return reaches


def fanouts(ops: list[Any], by_name: dict[str, Any]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """layer -> [(neuron, fan-out per neuron position)], the accumulates one spike causes."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    carried = _feeds_weighted(ops)
    with torch.inference_mode(False), torch.enable_grad():  # compile() may run under no_grad
        for op in ops:
            if op.kind in WEIGHTED and op.name not in carried:
                _fanout_of(op, by_name, out, carried)
    return out


def _sources(op: Any, by_name: dict[str, Any], carried: set[str]) -> list[tuple[str, list[Any]]]:
    """(neuron name, ops between it and ``op``) for every spike path into ``op`` (through
    pass-through ops and the folded ops in ``carried``)."""
    found = []

    def walk(name: str, chain: list[Any]) -> None:
        src = by_name[name]
        if src.kind in SPIKING:
            found.append((src.name, chain))
        elif src.kind in PASS or src.name in carried:
            for i in src.inputs:
                walk(i, [src] + chain)

    for i in op.inputs:
        walk(i, [])
    return found


def _fanout_of(op: Any, by_name: dict[str, Any], out: dict, carried: set[str]) -> None:
    """d(sum of ``op``'s outputs with unit weights)/d(each spike): its structural fan-out."""
    for neuron, chain in _sources(op, by_name, carried):
        x = torch.ones(1, *by_name[neuron].out_shape, dtype=torch.float64, requires_grad=True)
        y = x
        for c in chain:
            y = _structural(c, y)
        y = _structural(op, y)
        (g,) = torch.autograd.grad(y.sum(), x)
        out.setdefault(op.name, []).append((neuron, g.reshape(-1).detach()))


def _structural(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``op`` with every weight 1 and pooling as a sum: the connectivity it has, as a function."""
    p = op.params
    if op.kind in ("conv1d", "conv2d"):
        w = (torch.as_tensor(p["weight"] != 0, dtype=x.dtype) if p.get("placement")
             else torch.ones(p["weight"].shape, dtype=x.dtype))
        conv = F.conv2d if op.kind == "conv2d" else F.conv1d
        return conv(x, w, None, tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]),
                    int(p["groups"]))
    if op.kind in ("affine", "linear"):
        return F.linear(x, torch.as_tensor(p["weight"] != 0, dtype=x.dtype) if p.get("placement")
                        else torch.ones(p["weight"].shape, dtype=x.dtype))
    if op.kind == "scale":
        return x
    if op.kind in ("avgpool2d", "sumpool2d"):
        if p.get("adaptive", False):
            return F.adaptive_avg_pool2d(x, tuple(op.out_shape[-2:])) * math.prod(
                s // o for s, o in zip(x.shape[-2:], op.out_shape[-2:]))
        return F.avg_pool2d(x, tuple(p["kernel_size"]), tuple(p["stride"]), tuple(p["padding"]),
                            divisor_override=1)
    if op.kind == "flatten":
        a, e = flatten_dims(int(p["start_dim"]), int(p["end_dim"]), len(op.in_shape))
        return x.flatten(a, e)
    return x  # sum


def _conv(op: Any) -> float:
    p = op.params
    return float(conv_macs(op.in_shape, tuple(p["weight"].shape), p["stride"], p["padding"], p["dilation"]))


#: weighted op kind -> the ANN's multiply-accumulates of one op for one input, or None where the
#: ANN multiplies nothing there (a Scale: a residual shortcut's identity, or a constant factor)
MACS: dict[str, Callable[[Any], float] | None] = {
    "conv1d": _conv, "conv2d": _conv,
    "affine": lambda op: float(linear_macs(tuple(op.params["weight"].shape))),
    "linear": lambda op: float(linear_macs(tuple(op.params["weight"].shape))),
    "scale": None,
}


def macs_per_image(ops: list[Any]) -> dict[str, float]:
    """Multiply-accumulates of the ANN per weighted op, for one input (:data:`MACS`: a
    convolution's synapses, :func:`snnconv.analysis.energy.conv_macs`, padding excluded; a
    linear layer's weights)."""
    macs = {}
    for op in ops:
        count = MACS.get(op.kind)
        if count is not None and not op.params.get("placement"):  # a concatenation's part: no ANN synapse
            macs[op.name] = count(op)
    return macs


class Stats:
    """Spike counts per neuron and step, and synaptic operations per layer, over a run.

    Batch sums are accumulated where the spikes are (no device synchronisation per layer) and
    brought to the CPU once, by :meth:`finish`.
    """

    def __init__(self, bound: BoundGraph, T: int):
        self.T = T
        self.names = list(bound.neurons)
        self.acc: dict[str, torch.Tensor] = {}
        self.ties = 0.0
        self._ties: list[torch.Tensor] = []

    def add_neuron(self, name: str, s: torch.Tensor, per_pos: torch.Tensor | None = None) -> None:
        """Record spikes ``s`` ``[T, b, ...]`` (or their batch sum ``per_pos`` ``[T, M]``)."""
        if per_pos is None:
            # exact: at most b <= 2**24 ones are summed in float32
            per_pos = s.reshape(s.shape[0], s.shape[1], -1).sum(1, dtype=torch.float32)
        per_pos = per_pos.to(torch.float64)
        self.acc[name] = self.acc[name] + per_pos if name in self.acc else per_pos

    def add_ties(self, count: torch.Tensor) -> None:
        self._ties.append(count)

    def finish(self, bound: BoundGraph) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(spikes per neuron ``[T]`` float64 on the CPU, synaptic operations per layer)."""
        acc = {k: v.cpu() for k, v in self.acc.items()}
        spikes = {n: acc[n].sum(1) if n in acc else torch.zeros(self.T, dtype=torch.float64)
                  for n in self.names}
        positions = {n: a.sum(0) for n, a in acc.items()}
        synops = {}
        for layer, pairs in bound.fanout.items():
            total = 0.0
            for neuron, fan in pairs:
                if neuron in positions:
                    total += float((positions[neuron] * fan).sum())
            synops[layer] = total
        self.ties = float(sum(float(t) for t in self._ties))
        return spikes, synops
