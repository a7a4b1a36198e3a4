"""Bias (and membrane) calibration: shift each IF layer's bias, or its initial membrane, so
that its mean output over T steps matches the QCFS-ANN's, layer by layer in one pass
(:func:`calibrate_bias`), optionally with the weight fit of :mod:`.weights` in the same pass."""

from __future__ import annotations

import copy
import numbers
import operator
from typing import Any, Callable, cast

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.activation import QCFS
from snnconv.calibration.membrane import charge_counts, counted, fire, fit_shift
from snnconv.calibration.reference import calibration_batches, reference_means, reference_sites
from snnconv.calibration.weights import RIDGE, WeightCalibration
from snnconv.errors import ConfigError, StageOrderError
from snnconv.graph import (
    GroupStore,
    NodeOutputs,
    call_counts,
    largest_value,
    module_of,
    prepare,
    run_grouped,
    run_lockstep,
)
from snnconv.memory import budget_bytes, refuse_one_image
from snnconv.snn.network import SpikingNetwork, check_T, images_per_chunk
from snnconv.snn.neuron import IFNeuron, TimeExpand, channel_view, neurons
from snnconv.stages.spiking import LAYERS

__all__ = ["calibrate_bias", "calibrate_bias_by_rerun", "bias_path", "apply_shift"]


def bias_path(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The Conv/Linear node whose bias shifts the input of IF ``node``, and the nodes between.

    Through TimeExpand, or one argument of an add (the first Conv/Linear among its arguments).
    """
    src = cast(fx.Node, node.args[0])
    path = []
    while isinstance(module_of(gm, src), TimeExpand):
        path.append(src)
        src = cast(fx.Node, src.args[0])
    if isinstance(module_of(gm, src), LAYERS):
        return src, path
    if src.op == "call_function" and src.target in (operator.add, torch.add):
        a: Any
        for a in src.args:
            inner = []
            while isinstance(a, fx.Node) and isinstance(module_of(gm, a), TimeExpand):
                inner.append(a)
                a = a.args[0]
            if isinstance(a, fx.Node) and isinstance(module_of(gm, a), LAYERS):
                return a, path + [src] + inner
    return None


def _bias_layer(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The Conv/Linear whose bias shifts the input of IF ``node`` (through TimeExpand or an add)."""
    hit = bias_path(gm, node)
    return None if hit is None else module_of(gm, hit[0])


def _shift_reaches_only(gm: fx.GraphModule, node: fx.Node, hit: tuple[fx.Node, list[fx.Node]],
                        calls: dict[str, int]) -> bool:
    """Whether a bias shift of the layer in ``hit`` reaches IF ``node`` and nothing else."""
    layer_node, path = hit
    if calls.get(str(layer_node.target), 0) != 1:
        return False
    return all(len(n.users) == 1 for n in [layer_node, *path])


def apply_shift(layer: Any, delta: torch.Tensor) -> torch.Tensor:
    """Add ``delta`` (per output channel, or its mean) to ``layer``'s bias; return what was added."""
    delta = delta.to(layer.weight.dtype)
    with torch.no_grad():
        if layer.bias is None:
            layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype,
                                                  device=layer.weight.device))
        shift = delta.reshape(-1) if delta.numel() == layer.bias.numel() else delta.mean()
        before = layer.bias.detach().clone()
        layer.bias += shift
        return layer.bias.detach() - before


class _StopRun(Exception):
    pass


class _RunUntil(fx.Interpreter):
    """Run a graph until node ``name`` and return its value (the rest is not computed)."""

    def __init__(self, gm: fx.GraphModule, name: str):
        super().__init__(gm)
        self.name = name
        self.value: Any = None

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name == self.name:
            self.value = out
            raise _StopRun
        return out


def _value_at(gm: fx.GraphModule, x: torch.Tensor, name: str) -> torch.Tensor:
    interp = _RunUntil(gm, name)
    try:
        with torch.no_grad():
            interp.run(x)
    except _StopRun:
        pass
    return interp.value


def _bias_setup(snn: SpikingNetwork, reference: nn.Module, loader: Any, T: int | None,
                num_batches: int, horizons: tuple[int, int] | None = None, membrane: bool = False,
                weights: bool = False):
    """Calibration batches, the reference's per-channel mean output per QCFS site (a pair of
    them, at ``L = T1`` and ``L = T2``, with ``horizons``; T is then T2), the copy, the
    checked horizons (a pair of ints, or None) and the weight fit
    (:class:`~snnconv.calibration.weights.WeightCalibration`, or None).
    ``membrane``: the reference at ``L = T``."""
    if not isinstance(snn, SpikingNetwork) or "neurons" not in snn.meta:
        raise StageOrderError("calibrate_bias needs a SpikingNetwork made by to_spiking (its meta "
                              "maps each neuron to its QCFS site)")
    if horizons is not None and membrane:
        raise ConfigError("membrane=True calibrates at one T; give T, not horizons")
    if membrane:
        _check_subtractive(snn, "membrane calibration", "calibrate its bias instead: membrane=False")
    if horizons is not None:
        horizons = _check_horizons(snn, horizons)
        T = horizons[1]
    T = snn.T if T is None else T
    check_T(T)
    batches = calibration_batches(loader, num_batches, "bias calibration loader")
    ref = prepare(reference, leaf_types=(QCFS,))
    ref_nodes = reference_sites(ref)
    device = next(snn.parameters()).device
    ref.to(device)
    batches = [x.to(device) for x in batches]
    out = copy.deepcopy(snn)
    # t steps of neurons of bursts of up to B spikes: t * B levels
    burst = max((m.burst for m in neurons(out.net).values()), default=1)
    # the membrane's reference means come from the weight fit's reference pass (both at L = T)
    fit = WeightCalibration(out.net, ref, batches, T, ref_nodes if membrane else None,
                            levels=T * burst) if weights else None
    if fit is not None and fit.means is not None:
        target_mean: Any = fit.means
    elif horizons is None:
        target_mean = reference_means(ref, ref_nodes, batches, T * burst if membrane else None)
    else:
        target_mean = tuple(reference_means(ref, ref_nodes, batches, h * burst) for h in horizons)
    return T, batches, target_mean, out, horizons, fit


def _check_horizons(snn: SpikingNetwork, horizons: Any) -> tuple[int, int]:
    if (not isinstance(horizons, (tuple, list)) or len(horizons) != 2
            or any(isinstance(h, bool) or not isinstance(h, numbers.Integral) for h in horizons)
            or not 1 <= horizons[0] < horizons[1]):
        raise ConfigError(f"horizons must be two integers 1 <= T1 < T2, got {horizons!r}")
    _check_subtractive(snn, "membrane calibration (horizons)", "calibrate it at one T instead")
    return int(horizons[0]), int(horizons[1])


def _check_subtractive(snn: SpikingNetwork, what: str, instead: str) -> None:
    """Refuse ``what`` (it moves the initial membrane) on a network with hard-reset neurons."""
    hard = [n for n, m in neurons(snn.net).items() if m.reset != "subtract"]
    if hard:
        raise ConfigError(f"{what} needs subtractive-reset neurons; {hard[0]} resets to zero ({instead})")


def _finish(out: SpikingNetwork, snn: SpikingNetwork, T: int, batches: list, shifts: dict,
            method: str, horizons: tuple[int, int] | None = None, membrane: bool = False,
            wfit: WeightCalibration | None = None) -> SpikingNetwork:
    out.T = snn.T
    out.meta = copy.deepcopy(snn.meta)
    out.meta["bias_calibration"] = {"T": T, "batches": len(batches), "method": method,
                                    "mean_abs_shift": shifts}
    if horizons is not None:
        out.meta["bias_calibration"]["horizons"] = list(horizons)
    if membrane:
        out.meta["bias_calibration"]["membrane"] = True
    if wfit is not None:
        out.meta["bias_calibration"]["weights"] = {"T": wfit.T, "ridge": RIDGE,
                                                   "relative_change": wfit.changes}
    if horizons is not None or membrane:
        out.meta["bias_calibration"]["v_init"] = {
            n: {"min": float(m.v_init.min()), "mean": float(m.v_init.mean()), "max": float(m.v_init.max())}
            for n, m in neurons(out.net).items()}
    return out


def calibrate_bias(snn: SpikingNetwork, reference: nn.Module, loader: Any, *,
                   T: int | None = None, num_batches: int = 4,
                   horizons: tuple[int, int] | None = None, membrane: bool = False,
                   weights: bool = False, group_size: int | None = None) -> SpikingNetwork:
    """Shift biases so each IF layer's mean output over ``T`` steps matches the QCFS-ANN's.

    Layer by layer in graph order (each correction sees the corrected layers before it), the
    per-channel mean of ``theta * spike rate`` on calibration data is compared with the mean
    QCFS output of the same site in ``reference`` (the model ``snn`` was made from), and the
    difference is added to the bias of the Conv/Linear feeding that neuron. This removes the
    systematic under-firing of deep layers at few steps (the light calibration of Li et al.,
    ICML 2021). Works on a copy; ``result.meta["bias_calibration"]`` records the shifts.

    A bias shift is right for one ``T`` only: calibrated at T=8, a network over-corrects at
    T=32. ``horizons=(T1, T2)`` (subtractive reset only) calibrates at two T: the
    SNN runs ``T2`` steps, and per channel the error at ``t`` steps, against the reference with
    its QCFS at ``L = t`` levels (what a t-step IF layer computes on a constant input), is
    modelled as ``a + b / t``; solved at ``t = T1`` and ``T2``, ``a`` shifts the bias and ``b``
    the neuron's initial membrane ``v_init`` (a shift of ``b`` in the first step's charge moves
    the mean over t steps by ``b / t``), clamped to ``[0, 1]`` of theta. This is the potential
    calibration of Li et al. (ICML 2021) and the error model of Bu et al. (ICLR 2022) and Hao
    et al. (AAAI 2023), fitted per channel; ``T`` is then ignored. Beyond ``T2`` the bias ``a``
    (curvature of the error between the horizons) stays and the network drifts away.

    ``membrane=True`` (subtractive reset; :func:`snnconv.convert`'s default, at twice the
    network's T) corrects through the initial membrane alone: per channel the error ``e`` at
    ``T`` steps, against the reference at ``L = T`` levels, moves ``v_init`` by ``e * T``
    (clamped to ``[0, 1]`` of theta; the bias gets only what the clamp leaves). A soft-reset IF
    layer's error falls as ``1 / t`` (its spike count is the charge in, minus a membrane that
    stays bounded), so a bias shift, which stays at every T, is right at its horizon(s) only:
    fitted as ``a + b / t`` at (8, 16), ResNet-20 fell from 75 to 61% at T=64, where the
    membrane alone converges to the ANN (benchmarks/README.md "Membrane-only calibration").

    ``weights=True`` (:func:`snnconv.convert`'s default with the membrane calibration) also
    refits the weights of every Conv2d/Linear that reads spikes, in the same pass, before its
    neuron is calibrated (the advanced calibration of Li et al., ICML 2021, solved in closed
    form): per layer, ridge least squares of the layer's output on the SNN's input rates over
    ``T`` steps (the last horizon) against the QCFS-ANN's output at ``L = T`` levels, over the
    output positions of the calibration images (all of them up to 16 per weight of an output
    channel, at least 4096; a seeded sample beyond, the same in every run), pulled towards the
    present weights (ridge ``1e-2`` of the mean diagonal of the normal matrix). It corrects
    how the spike rates of a few steps differ from the ANN's values image by image, which no
    per-channel shift can. Fitted at the network's own T (where its bias or membrane is not)
    it is right at that T only (ResNet-20: +18 points at T=8, -35 at T=16); at ``2 * T`` with
    the membrane, better at T = 4-16 on the robustness matrix and about even at T=32
    (benchmarks/README.md "Weight calibration"). It reads each layer's input without changing
    it (an observer of :func:`snnconv.graph.run_lockstep`), and keeps the reference's output
    at the sampled positions only. ``meta["bias_calibration"]["weights"]`` records each
    layer's relative weight change.

    Cost: one T-step pass of the SNN over the ``num_batches`` batches, all of them layer by
    layer in lockstep (:func:`snnconv.graph.run_lockstep`; on a CPU in chunks of at most
    ``snn.chunk_size`` time-folded samples and 16 MiB per value; memory is that of a forward
    at ``num_batches`` times the batch size, with each value made just before its first use
    and spikes that a shortcut still needs kept as bool): at each neuron the input is divided by theta in
    place, the IF recursion on it gives the spike counts (from the membrane left at the
    horizons; the spike train is not stored) and so the shift, then the neuron fires on the
    same tensor with the shift folded into its threshold, and its spikes go on to the next
    layers (and where a fitted layer reads them, their rates over the steps, from each
    position's charge and last membrane); plus one reference forward of the QCFS-ANN per
    horizon. On a 2-core CPU about 1.2-1.4x a T-step pass, with the weight fit 1.5x (ResNet-20)
    to 1.65x (ResNet-18, whose wide layers' normal equations dominate; benchmarks/README.md). Where a
    shifted layer's output also reaches other nodes (or its module is called twice), that
    shortcut is not exact and each layer is re-run from the input instead (quadratic in depth;
    ``meta["bias_calibration"]["method"] == "rerun"``).

    Memory: where that forward of every calibration image at once would not fit
    (:func:`snnconv.memory.budget_bytes`; about twice the largest value of the network per
    image), or ``group_size`` asks for it, the images go through in groups of at most
    ``group_size`` images (default: as many as fit half the budget): between two corrections
    each group runs twice, once to count its spikes and once, after the shift is known, to
    fire (about 2x the time of the single pass); between corrections a group keeps only its
    live values, spikes as bool, in memory up to half the budget and in a temporary folder
    beyond. The same network up to float rounding (``method == "grouped"``).

    Raises:
        StageOrderError: ``snn`` does not record which QCFS site each neuron came from.
        DataError: the loader is empty.
        ResourceError: a single image does not fit the memory.
    """
    T, batches, target_mean, out, horizons, wfit = _bias_setup(snn, reference, loader, T, num_batches,
                                                               horizons, membrane, weights)
    gm = out.net
    shifts: dict[str, Any] = {}
    plan = _shift_plan(gm, snn, target_mean, shifts)
    if plan is None:
        return _rerun(snn, T, batches, target_mean, out, horizons, membrane, wfit)
    out.T = T
    per, group_size, budget = _chunking(snn, gm, batches, T, group_size)
    cut = _chunks(batches, per)
    if group_size is not None:
        return _grouped(out, snn, T, batches, target_mean, horizons, membrane, wfit, plan, shifts, cut,
                        group_size, budget)
    return _one_pass(out, snn, T, batches, target_mean, horizons, membrane, wfit, plan, shifts, cut)


def _shift_plan(gm: fx.GraphModule, snn: SpikingNetwork, target_mean: Any, shifts: dict) -> list[tuple] | None:
    """Per neuron to correct, in graph order: its node's name, the neuron, its name, its QCFS
    source and the layer whose bias moves; None where a shift would reach other nodes than its
    neuron (or a module is called twice), so that the single pass is not exact."""
    calls = call_counts(gm)
    plan: list[tuple] = []
    for node in gm.graph.nodes:
        site = _shift_site(gm, node, snn, target_mean, bias_path, shifts)
        if site is None:
            continue
        neuron_mod, source, hit = site
        if calls.get(str(node.target), 0) != 1 or not _shift_reaches_only(gm, node, hit, calls):
            return None
        plan.append((node.name, neuron_mod, str(node.target), source, module_of(gm, hit[0])))
    return plan


def _chunking(snn: SpikingNetwork, gm: fx.GraphModule, batches: list, T: int, group_size: int | None
              ) -> tuple[int | None, int | None, int | None]:
    """Images per chunk (None: whole batches), images per group (None: all images at once, where
    their lockstep fits the memory and ``group_size`` is None) and the memory budget."""
    # cache-sized chunks on a CPU (as SpikingNetwork's chunk_size), each inside one batch
    per = None
    per_image = largest_value(gm, batches[0][:1])  # all T steps of one image
    device = batches[0].device
    # the lockstep needs about twice its largest value over all images
    need, budget = 2 * per_image * sum(len(x) for x in batches), budget_bytes(device)
    grouped = group_size is not None or (budget is not None and need > budget)
    if grouped:
        refuse_one_image(2 * per_image, device, f"bias calibration at T={T}", "lower T or the input size")
        if group_size is None:
            assert budget is not None  # grouped without a size: the lockstep passed the budget
            group_size = max(1, budget // 2 // (2 * per_image))
    if snn.chunk_size and device.type == "cpu":
        per = images_per_chunk(snn.chunk_size, T, per_image)
    if grouped:
        assert group_size is not None
        per = min(per or group_size, group_size)
    return per, group_size, budget


def _one_pass(out: SpikingNetwork, snn: SpikingNetwork, T: int, batches: list, target_mean: Any,
              horizons: tuple[int, int] | None, membrane: bool, wfit: WeightCalibration | None,
              plan: list, shifts: dict, cut: tuple[list, list, list]) -> SpikingNetwork:
    """:func:`calibrate_bias`'s single pass over every calibration image at once
    (:func:`snnconv.graph.run_lockstep`)."""
    chunks, owner, spans = cut
    gm = out.net
    steps = (T,) if horizons is None else horizons
    # the spike rates of the neurons whose spikes a fitted layer reads directly: from each
    # position's charge and last membrane as the neuron fires (no pass over the spikes), kept
    # until the last such layer has been fitted
    readers: dict[str, int] = {}
    rates: dict[str, list] = {}
    if wfit is not None:
        for node in gm.graph.nodes:
            if node.name in wfit.plan and isinstance(node.args[0], fx.Node):
                readers[node.args[0].name] = readers.get(node.args[0].name, 0) + 1

    def correct(xs, node_name, mod, name, source, layer):
        along_last = isinstance(layer, nn.Linear) and xs[0].dim() > 2  # bias on the last dim
        charges = [] if node_name in readers else None
        if mod.reset == "subtract" and not along_last:
            # divide by theta once, in place (every node from the layer to this neuron has this
            # one user); count from it, then fire on it with the shift, spikes in place: no
            # second division, no pass to add the shift, no new tensor
            theta = channel_view(mod.theta, xs[0].dim())
            us = [(x.div_(theta) if x.is_contiguous() else x / theta).reshape(T, len(x) // T, *x.shape[1:])
                  for x in xs]
            parts = [(charge_counts(mod, u, steps, charges), u[0].numel() // u.shape[2], k)
                     for u, k in zip(us, owner)]
        else:
            us, parts = None, [counted(mod, x, T, k, steps) for x, k in zip(xs, owner)]
        delta = fit_shift(mod, parts, len(batches), T, _target(target_mean, source), horizons, membrane)
        del parts
        added = apply_shift(layer, delta)
        shifts[name] = float(delta.abs().mean())
        if us is not None:
            shift = channel_view(added, xs[0].dim()) / channel_view(mod.theta, xs[0].dim())
            if not charges or charges[0] is None:
                return NodeOutputs((fire(mod, u, shift).reshape(x.shape) for u, x in zip(us, xs)),
                                   spikes=True)
            spikes, rates[node_name] = [], []
            for i, (u, x) in enumerate(zip(us, xs)):
                s, r = fire(mod, u, shift, charges[i])
                charges[i] = None
                spikes.append(s.reshape(x.shape))
                rates[node_name].append(r)
            return NodeOutputs(spikes, spikes=True)
        view = added if along_last else channel_view(added, xs[0].dim())
        # in place: every node from the layer to this neuron has this one user
        return [x.add_(view) if x.is_contiguous() else x + view for x in xs]

    before = {node_name: (lambda xs, nn_=node_name, m=mod, n=name, s=source, lay=layer:
                          correct(xs, nn_, m, n, s, lay))
              for node_name, mod, name, source, layer in plan}

    def fit(xs, node):
        source = node.args[0].name
        known = rates.get(source)
        if known is not None:
            readers[source] -= 1
            if not readers[source]:
                del rates[source]
        wfit.fit(node, xs, spans, known)

    observe: dict[str, Any] = {}
    if wfit is not None:
        observe = {node.name: (lambda xs, n=node: fit(xs, n)) for node in gm.graph.nodes
                   if node.name in wfit.plan}
    with torch.no_grad():
        run_lockstep(gm, chunks, before, observe)
    return _finish(out, snn, T, batches, _in_order(gm, shifts), "one-pass", horizons, membrane, wfit)


def _in_order(gm: fx.GraphModule, shifts: dict) -> dict:
    """``shifts`` in the order of the neurons in ``gm``'s graph."""
    return {n: shifts[n] for n in [str(node.target) for node in gm.graph.nodes
                                   if isinstance(module_of(gm, node), IFNeuron)] if n in shifts}


def _chunks(batches: list, per: int | None) -> tuple[list, list, list]:
    """The batches cut into chunks of at most ``per`` images (None: whole), each chunk's batch
    and its span (batch, first image, end)."""
    chunks, owner, spans = [], [], []
    for k, x in enumerate(batches):
        lo = 0
        for c in (x.split(per) if per else [x]):
            chunks.append(c)
            owner.append(k)
            spans.append((k, lo, lo + len(c)))
            lo += len(c)
    return chunks, owner, spans


class _Shift:
    """The correction of one IF neuron as a :func:`snnconv.graph.run_grouped` hook: counts its
    spikes group by group, fits the shift once all are counted, then fires with it (the
    arithmetic of :func:`calibrate_bias`'s single pass, without the rates it hands on)."""

    spikes = True

    def __init__(self, mod, name, layer, target, ctx: dict):
        self.mod, self.name, self.layer, self.target, self.ctx = mod, name, layer, target, ctx
        self.parts: list = []
        self.replaces: bool | None = None  # known from the first input: dividing by theta or adding to it
        self.added: Any = None

    def prepare(self, xs: list) -> list:
        x0, T = xs[0], self.ctx["T"]
        if self.replaces is None:
            along_last = isinstance(self.layer, nn.Linear) and x0.dim() > 2  # bias on the last dim
            self.replaces = self.mod.reset == "subtract" and not along_last
        if not self.replaces:
            return xs
        theta = channel_view(self.mod.theta, x0.dim())
        return [(x.div_(theta) if x.is_contiguous() else x / theta).reshape(T, len(x) // T, *x.shape[1:])
                for x in xs]

    def measure(self, values: list, members: list) -> None:
        owner, steps, T = self.ctx["owner"], self.ctx["steps"], self.ctx["T"]
        for v, i in zip(values, members):
            self.parts.append((charge_counts(self.mod, v, steps), v[0].numel() // v.shape[2], owner[i])
                              if self.replaces else counted(self.mod, v, T, owner[i], steps))

    def settle(self) -> None:
        c = self.ctx
        delta = fit_shift(self.mod, self.parts, c["batches"], c["T"], self.target, c["horizons"], c["membrane"])
        self.parts = []
        # the groups that run again compute the layer with its bias as it was: the shift is
        # folded into their firing, as into the first group's, and applied to the layer at the end
        layer, old = self.layer, self.layer.bias
        kept = None if old is None else old.detach().clone()
        self.added = apply_shift(layer, delta)
        self.bias = layer.bias.detach().clone()
        with torch.no_grad():
            if kept is None:
                layer.bias = None
            else:
                layer.bias.copy_(kept)
        c["shifts"][self.name] = float(delta.abs().mean())

    def done(self) -> None:
        with torch.no_grad():
            if self.layer.bias is None:
                self.layer.bias = nn.Parameter(self.bias)
            else:
                self.layer.bias.copy_(self.bias)

    def emit(self, values: list, members: list) -> list:
        if self.replaces:
            dims = values[0].dim() - 1
            shift = channel_view(self.added, dims) / channel_view(self.mod.theta, dims)
            return [cast(torch.Tensor, fire(self.mod, u, shift)).reshape(-1, *u.shape[2:]) for u in values]
        along_last = isinstance(self.layer, nn.Linear) and values[0].dim() > 2
        view = self.added if along_last else channel_view(self.added, values[0].dim())
        return [x.add_(view) if x.is_contiguous() else x + view for x in values]


class _Fit:
    """The weight fit of one layer as a :func:`snnconv.graph.run_grouped` hook (it reads the
    layer's input and leaves it as it is)."""

    replaces, spikes = False, False

    def __init__(self, node: fx.Node, wfit: WeightCalibration, spans: list, source: Any = None):
        self.node, self.wfit, self.spans, self.source = node, wfit, spans, source
        self.acc: Any = None

    def prepare(self, xs: list) -> list:
        return xs

    def measure(self, values: list, members: list) -> None:
        if self.acc is None:  # the spikes of a corrected neuron: counts over T, exact (as the single pass)
            self.acc = self.wfit.start(self.node, counts=self.source is not None and bool(self.source.replaces))
        self.wfit.add(self.node, self.acc, values, [self.spans[i] for i in members])

    def settle(self) -> None:
        self.wfit.solve(self.node, self.acc)
        self.acc = None

    def emit(self, values: list, members: list) -> list:
        return values

    def done(self) -> None:
        pass


def _grouped(out: SpikingNetwork, snn: SpikingNetwork, T: int, batches: list, target_mean: Any,
             horizons: tuple[int, int] | None, membrane: bool, wfit: WeightCalibration | None,
             plan: list, shifts: dict, cut: tuple[list, list, list], group_size: int,
             budget: int | None) -> SpikingNetwork:
    """:func:`calibrate_bias`'s single pass, a group of at most ``group_size`` images at a time
    (:func:`snnconv.graph.run_grouped`)."""
    chunks, owner, spans = cut
    gm = out.net
    ctx = {"T": T, "steps": (T,) if horizons is None else horizons, "batches": len(batches),
           "horizons": horizons, "membrane": membrane, "owner": owner, "shifts": shifts}
    hooks: dict[str, Any] = {node_name: _Shift(mod, name, layer, _target(target_mean, source), ctx)
                             for node_name, mod, name, source, layer in plan}
    if wfit is not None:
        shifts_at = dict(hooks)
        hooks.update({node.name: _Fit(node, wfit, spans, shifts_at.get(str(getattr(node.args[0], "name", ""))))
                      for node in gm.graph.nodes if node.name in wfit.plan})
    groups: list[Any] = []
    size = 0
    for i, c in enumerate(chunks):
        if not groups or size + len(c) > group_size:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += len(c)
    store = GroupStore(None if budget is None else budget // 2)
    with torch.no_grad():
        run_grouped(gm, chunks, groups, hooks, store)
    result = _finish(out, snn, T, batches, _in_order(gm, shifts), "grouped", horizons, membrane, wfit)
    result.meta["bias_calibration"]["groups"] = {"count": len(groups), "images": group_size,
                                                 "spilled_to_disk": store.spilled}
    return result


def _shift_site(gm: fx.GraphModule, node: fx.Node, snn: SpikingNetwork, target_mean: Any, find: Callable,
                shifts: dict) -> tuple[IFNeuron, Any, Any] | None:
    """``(neuron, its QCFS source, find(gm, node))`` when ``node`` is an IF neuron with a QCFS
    reference and a bias to shift; else None, with a skipped neuron recorded in ``shifts``."""
    neuron_mod = module_of(gm, node)
    if not isinstance(neuron_mod, IFNeuron):
        return None
    source = snn.meta["neurons"].get(str(node.target), {}).get("source")
    site = find(gm, node)
    if _target(target_mean, source) is None or site is None:
        shifts[str(node.target)] = "skipped: no QCFS reference or no bias to shift"
        return None
    return neuron_mod, source, site


def _target(target_mean: Any, source: Any) -> Any:
    """The reference mean(s) of QCFS site ``source``, or None."""
    if isinstance(target_mean, tuple):
        return None if source not in target_mean[0] else tuple(t[source] for t in target_mean)
    return target_mean.get(source)


def _rerun(snn: SpikingNetwork, T: int, batches: list, target_mean: Any,
                          out: SpikingNetwork, horizons: tuple[int, int] | None = None,
                          membrane: bool = False, wfit: WeightCalibration | None = None) -> SpikingNetwork:
    """The reference algorithm: for each neuron (and layer whose weights are fitted), re-run
    the corrected network up to it."""
    out.T = T
    gm = out.net
    shifts: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if wfit is not None and node.name in wfit.plan:
            values = (_value_at(gm, x, node.args[0].name) for x in batches)  # one batch's at a time
            wfit.fit(node, values, [(k, 0, len(x)) for k, x in enumerate(batches)])
        site = _shift_site(gm, node, snn, target_mean, _bias_layer, shifts)
        if site is None:
            continue
        neuron_mod, source, layer = site
        # the neuron's own spikes ([T*b, ...]), one batch's at a time: counted, not re-run
        parts = [counted(None, _value_at(gm, x, node.name), T, k, (T,) if horizons is None else horizons)
                 for k, x in enumerate(batches)]
        delta = fit_shift(neuron_mod, parts, len(batches), T, _target(target_mean, source), horizons,
                          membrane)
        apply_shift(layer, delta)
        shifts[str(node.target)] = float(delta.abs().mean())
    return _finish(out, snn, T, batches, shifts, "rerun", horizons, membrane, wfit)


def calibrate_bias_by_rerun(snn: SpikingNetwork, reference: nn.Module, loader: Any, *,
                             T: int | None = None, num_batches: int = 4,
                             horizons: tuple[int, int] | None = None,
                             membrane: bool = False, weights: bool = False) -> SpikingNetwork:
    """:func:`calibrate_bias` by the quadratic re-run algorithm (the reference in the tests)."""
    T, batches, target_mean, out, horizons, wfit = _bias_setup(snn, reference, loader, T, num_batches,
                                                               horizons, membrane, weights)
    return _rerun(snn, T, batches, target_mean, out, horizons, membrane, wfit)
