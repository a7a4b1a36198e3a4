"""A :class:`~snnconv.snn.network.SpikingNetwork` run one time step at a time, on a batch whose
images may leave between steps: the early-exit evaluation of the torch network.

:meth:`SpikingNetwork.run` folds time into the batch (``[T*B, ...]`` through every layer), so
every image pays all T steps. :class:`Stepper` runs the same graph one step per call instead:
each neuron keeps its membrane between calls (:func:`~snnconv.snn.neuron.fire_subtractive_`
and the leaky step functions, the same arithmetic as the time-folded pass), the static layers
before the time expansion (direct encoding's first layer) run once per batch, and
:meth:`Stepper.keep` drops the images that have exited, from the input, the static values and
every neuron's state alike, so later steps cost only what the remaining images cost.

An image's per-step readouts are those of the time-folded run up to the rounding of the layers'
kernels at another batch size (bit for bit where those kernels give every image the same result
whatever the batch holds, which the tests check on exactly representable networks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.exit_rule import ExitRule
from snnconv.snn.neuron import (
    IFNeuron,
    LeakyNeuron,
    TimeExpand,
    channel_view,
    cubalif_step,
    fire_subtractive_,
    li_step,
    lif_step,
)

__all__ = ["ExitRun", "Stepper", "run_chunk_with_exit"]


class ExitRun(NamedTuple):
    """What an early-exit run gives per image: ``output`` (``[B, classes]``, the mean readout over
    the steps the image ran) and ``steps`` (``[B]`` int64, its exit step, 1..T)."""

    output: torch.Tensor
    steps: torch.Tensor


class _IFStep(nn.Module):
    """One step of an :class:`IFNeuron` per call, its membrane carried to the next call (the
    arithmetic of ``IFNeuron``'s pass without gradients, one step of it)."""

    def __init__(self, neuron: IFNeuron):
        super().__init__()
        self.neuron = neuron
        self.v: torch.Tensor | None = None
        self.last: torch.Tensor | None = None  # this step's spikes, where recorded
        self.record = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.neuron
        if m.reset == "zero":  # fire_zero's step: v += x; s = v >= theta; v -= v * s
            v = x.clone() if self.v is None else self.v.add_(x)
            s = torch.empty_like(x)
            torch.ge(v, channel_view(m.theta, x.dim()), out=s)
            v.addcmul_(v, s, value=-1.0)
            self.v = v
        else:
            s = x / channel_view(m.theta, x.dim())  # the input in units of theta; becomes the spikes
            v0 = channel_view(m.v_init.to(s.dtype), s.dim()) if self.v is None else self.v
            self.v = fire_subtractive_(s.unsqueeze(0), v0, burst=m.burst)
        self.last = s if self.record else None
        return s

    def keep(self, mask: torch.Tensor) -> None:
        if self.v is not None:
            self.v = self.v[mask]

    def clear(self) -> None:
        self.v = None


class _LeakyStep(nn.Module):
    """One step of a :class:`LeakyNeuron` per call (its step function, from the zero state)."""

    def __init__(self, neuron: LeakyNeuron):
        super().__init__()
        self.neuron = neuron
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None  # (i, v); i unused but for CubaLIF
        self.last: torch.Tensor | None = None
        self.record = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.neuron
        p = m.params.to(x.dtype, x.device)
        if self.state is None:
            zero = torch.zeros_like(x * p.k_mem)  # leaky_sequence's start
            self.state = (zero, zero)
        i, v = self.state
        if m.kind == "li":
            v = li_step(v, x, p)
            out = v
        elif m.kind == "lif":
            out, v = lif_step(v, x, p, detach_reset=m.detach_reset)
        else:
            out, (i, v) = cubalif_step((i, v), x, p, detach_reset=m.detach_reset)
        self.state = (i, v)
        self.last = out if self.record else None
        return out

    def keep(self, mask: torch.Tensor) -> None:
        if self.state is not None:
            self.state = (self.state[0][mask], self.state[1][mask])

    def clear(self) -> None:
        self.state = None


class _Held(nn.Module):
    """A static value (the input of a time expansion), computed once per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        assert self.value is not None, "Stepper.start sets the static values before the first step"
        return self.value


def _needed(outputs: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """The nodes ``outputs`` depend on, not looking past the nodes of ``stop``."""
    seen: set[fx.Node] = set()
    todo = list(outputs)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            todo.extend(node.all_input_nodes)
    return seen


class Stepper:
    """``net`` (a SpikingNetwork's graph) run one time step per :meth:`step`.

        stepper = Stepper(snn.net)
        stepper.start(x)            # a new batch: fresh neuron states, the static layers run once
        r1 = stepper.step()         # step 1's readout, [B, classes]
        stepper.keep(r1.argmax(1) != 3)   # drop some images
        r2 = stepper.step()         # step 2's readout of the images kept

    The graph's modules are shared with ``net``, not copied; each neuron call site gets a
    step module of its own that holds its state. Run it without gradients.

    Args:
        net: the graph of a :class:`~snnconv.snn.network.SpikingNetwork` (``snn.net``).
        record: keep each step's spikes: :attr:`spikes` after :meth:`step`.
    """

    def __init__(self, net: fx.GraphModule, *, record: bool = False):
        graph = net.graph
        self._record = bool(record)
        self._sites: list[str] = []  # each step module's neuron, by qualified name (#2: its second call)
        static: set[fx.Node] = set()  # computed from the input alone, before any neuron
        expands: list[fx.Node] = []  # time expansions of a static value: held, computed once
        modules: dict[str, object] = {}
        self._states: list[_IFStep | _LeakyStep] = []
        self._held: list[_Held] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                static.add(node)
                if node.op == "get_attr":
                    modules[node.target] = _attribute(net, node.target)
            elif node.op == "call_module":
                mod = net.get_submodule(node.target)
                if isinstance(mod, TimeExpand):
                    if node.all_input_nodes and all(n in static for n in node.all_input_nodes):
                        expands.append(node)
                    modules[node.target] = nn.Identity()  # where not held: one step is no expansion
                    continue
                modules[node.target] = mod
                if not isinstance(mod, (IFNeuron, LeakyNeuron)) and all(n in static for n in node.all_input_nodes):
                    static.add(node)
            elif node.op in ("call_function", "call_method") and all(n in static for n in node.all_input_nodes):
                static.add(node)
        output = next(n for n in graph.nodes if n.op == "output")
        self._static = self._graph(graph, modules, [e.args[0] for e in expands], set(), {}) if expands else None
        held = {e: f"_snnconv_held_{i}" for i, e in enumerate(expands)}
        for name in held.values():
            self._held.append(_Held())
            modules[name] = self._held[-1]
        self._dynamic = self._graph(graph, modules, [output], set(held), held, stateful=True)

    def _graph(self, graph: fx.Graph, modules: dict, outputs: list, stop: set, held: dict,
               stateful: bool = False) -> fx.GraphModule:
        """A graph module of the nodes ``outputs`` need; ``held`` nodes read their held value;
        ``stateful``: each neuron call site becomes a step module of its own."""
        needed = _needed([o for o in outputs if isinstance(o, fx.Node)], stop)
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        mods = dict(modules)
        for node in graph.nodes:
            if node.op == "output":
                break
            if node.op != "placeholder" and node not in needed:
                continue
            if node in held:
                env[node] = new.call_module(held[node], ())
                continue
            env[node] = new.node_copy(node, lambda n: env[n])
            mod = modules.get(node.target) if node.op == "call_module" else None
            if stateful and isinstance(mod, (IFNeuron, LeakyNeuron)):
                step = _IFStep(mod) if isinstance(mod, IFNeuron) else _LeakyStep(mod)
                step.record = self._record
                calls = sum(site.split("#")[0] == node.target for site in self._sites)
                self._sites.append(node.target + (f"#{calls + 1}" if calls else ""))
                self._states.append(step)
                env[node].target = f"_snnconv_step_{len(self._states)}"
                mods[env[node].target] = step
        if outputs and outputs[0].op == "output":
            new.output(fx.node.map_arg(outputs[0].args[0], lambda n: env[n]))
        else:
            new.output(tuple(env[o] for o in outputs))
        used = {n.target for n in new.nodes if n.op in ("call_module", "get_attr")}
        return fx.GraphModule({k: v for k, v in mods.items() if k in used}, new)

    def start(self, x: torch.Tensor) -> None:
        """A new batch ``x`` (``[B, ...]``, presented at every step): fresh neuron states; the
        static layers run on it once."""
        for s in self._states:
            s.clear()
        self._x = x
        values = self._static(x) if self._static is not None else ()
        for h, v in zip(self._held, values):
            h.value = v

    def step(self) -> torch.Tensor:
        """The next step's readout of the images still in the batch (``[b, ...]``)."""
        return self._dynamic(self._x)

    @property
    def spikes(self) -> dict[str, torch.Tensor]:
        """The last step's output of every neuron (``[b, ...]``), by the neuron's qualified name
        in ``net`` (a name called twice: ``name#2`` for its second call site); only with
        ``record=True``."""
        return {site: s.last for site, s in zip(self._sites, self._states) if s.last is not None}

    def keep(self, mask: torch.Tensor) -> None:
        """Keep only the images where ``mask`` (``[b]`` bool) is True, in their order."""
        self._x = self._x[mask]
        for h in self._held:
            assert h.value is not None
            h.value = h.value[mask]
        for s in self._states:
            s.keep(mask)


def _attribute(net: nn.Module, target: str) -> object:
    """The parameter, buffer or other attribute of ``net`` at the qualified name ``target``."""
    obj: object = net
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def run_chunk_with_exit(stepper: Stepper, x: torch.Tensor, rule: ExitRule, T: int) -> ExitRun:
    """One batch ``x`` run step by step with ``rule``: after each step the images whose
    accumulated readout meets the rule leave the batch. An image that exits at step ``k`` gets
    its accumulated readout divided by k, ``accumulate(readouts)[k - 1] / k``
    (:func:`snnconv.exit_rule.accumulate`: the sum of steps 1..k in step order)."""
    stepper.start(x)
    B = x.shape[0]
    alive = torch.arange(B, device=x.device)
    exits = torch.full((B,), T, dtype=torch.long, device=x.device)
    output: torch.Tensor | None = None
    total: torch.Tensor | None = None
    for k in range(1, T + 1):
        r = stepper.step()
        if output is None:
            output = r.new_empty((B, *r.shape[1:]))
        total = r if total is None else total + r  # the order of exit_rule.accumulate
        done = rule.met(total, k) if k < T else torch.ones(len(alive), dtype=torch.bool, device=x.device)
        if bool(done.any()):
            exits[alive[done]] = k
            output[alive[done]] = total[done] / k
            kept = ~done
            alive, total = alive[kept], total[kept]
            if not len(alive):
                break
            stepper.keep(kept)
    assert output is not None
    return ExitRun(output, exits)
