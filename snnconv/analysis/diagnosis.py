"""Where a converted network loses its accuracy: layer by layer, split by cause, and what each costs.

For every IF layer, on the user's data at the user's T, the spiking network's output rate ``r``
(spikes per step times theta) departs from the ANN's activation ``a`` at the same site. With
``m`` the time-mean of the current the neuron receives, ``f`` the site's ANN activation (a ReLU,
or a ReLU capped at ``a``), ``Q_T`` the rate the neuron reaches in T steps on the constant
current ``m`` (its own membrane start and reset), the departure splits exactly::

    r - a  =  [f(m) - a]                carried in: the layers before (and weights changed by
                                        calibration or fine-tuning) moved this layer's input
            + [clip(m, 0, theta) - f(m)] clipping above the threshold
            + [Q_T(m) - clip(m, 0, theta)] the T-level quantisation of the neuron's rate
            + [r - Q_T(m)]              temporal: the input was not constant over the T steps

Each cause is reported as its root mean square over the layer's outputs, relative to the
ANN activation's (so 1.0 is an error as large as the signal). The accuracy a layer costs is
measured, not inferred: the layer run as its ANN activation (every step it emits
``f(m) / theta``, the ANN's value on its mean input: its own departure is then zero) and the
network's output compared with the ANN's. Layers are ranked by what that recovers
(the KL divergence to the ANN's softmax that it removes), and the few that lose most are run as
ANN activations together to check the ranking. :func:`needed_T` measures the plain conversion
(QCFS at L = T, IF neurons, no calibration) at growing T: the steps this network needs.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.analysis.metrics import kl_to
from snnconv.calibration.reference import channel_sums
from snnconv.errors import ConfigError, DataError
from snnconv.graph import capture, module_of, prepare
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import IFNeuron, channel_view, neurons

__all__ = ["CAUSES", "ADVICE", "LayerDiagnosis", "Diagnosis", "diagnose", "ann_sites", "needed_T",
           "site_rates", "causes_of", "as_ann"]

#: The causes of a layer's departure, in the order they add up (see the module docstring).
CAUSES = ("carried", "clip", "quantisation", "temporal")

#: What addresses each cause, in the words of convert()'s options.
ADVICE = {
    "carried": "the layers before it (fix those first); or fine-tuning (finetune_epochs) to adapt its weights",
    "clip": "a higher threshold: percentile=100.0 or per_channel=True; or QCFS training (qcfs_epochs)",
    "quantisation": "more levels per step: burst=B (up to B spikes a step: T*B levels at no extra latency; "
                    "graded spikes, plain NIR IF consumers carry one per step) or a larger T (see the T needed); "
                    "or QCFS training at L=T (qcfs_epochs)",
    "temporal": "bias and membrane calibration (bias_calibration=True), fine-tuning (finetune_epochs), "
                "or a larger T",
    "dead": "per_channel=True (thresholds per channel), or a lower percentile",
}


@dataclass
class LayerDiagnosis:
    """One IF layer: its departure from the ANN by cause (relative RMS), its dead and saturated
    channels, and what running it as its ANN activation recovers."""

    name: str
    site: str | None  # the ANN's ReLU node behind it (None: no ANN site matched)
    units: int  # neurons per image
    channels: int
    departure: float  # RMS(r - a) / RMS(a)
    own_departure: float  # RMS(r - f(m)) / RMS(a): clip, quantisation and temporal together
    causes: dict[str, float]  # each cause's RMS / RMS(a)
    dead_channels: int  # channels that never fire where the ANN's are active
    saturated_channels: int  # channels that fire at every step on every position
    firing_rate: float  # spikes per neuron and step
    kl_recovered: float = 0.0  # KL(ANN || SNN) removed by running this layer as its ANN activation
    accuracy_alone: float | None = None  # the network's accuracy with this layer as its ANN activation

    @property
    def own(self) -> str:
        """The largest of the layer's own causes (clip, quantisation, temporal), or "dead"."""
        if self.dead_channels and self.dead_channels >= max(1, self.channels // 4):
            return "dead"
        return max(("clip", "quantisation", "temporal"), key=lambda c: self.causes.get(c, 0.0))


@dataclass
class Diagnosis:
    """What :func:`diagnose` found (JSON-ready with :meth:`to_dict`)."""

    T: int
    images: int
    labelled: bool
    ann_accuracy: float | None
    snn_accuracy: float | None
    ann_agreement: float  # the SNN's decisions equal to the ANN's, %
    kl: float  # mean KL(softmax(ANN) || softmax(SNN)) over the images
    layers: list[LayerDiagnosis]
    ranking: list[str] = field(default_factory=list)  # layers by KL recovered, largest first
    main: list[str] = field(default_factory=list)  # the few layers that lose most
    recovered: dict[str, float] = field(default_factory=dict)  # "k" -> accuracy with the top k as ANN
    main_accuracy: float | None = None  # the accuracy with the main layers as ANN activations
    needed: dict[str, Any] | None = None  # needed_T's record, where measured
    calibrated_T: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for layer, rec in zip(self.layers, d["layers"]):
            rec["own"] = layer.own
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Diagnosis":
        d = dict(d)
        layers = [LayerDiagnosis(**{k: v for k, v in rec.items() if k != "own"}) for rec in d.pop("layers")]
        return cls(layers=layers, **d)

    def gap_recovered(self) -> float | None:
        """The share of the ANN-SNN accuracy gap the main layers recover (None without labels
        or without a gap)."""
        if self.main_accuracy is None or self.ann_accuracy is None or self.snn_accuracy is None:
            return None
        gap = self.ann_accuracy - self.snn_accuracy
        return None if gap <= 0 else (self.main_accuracy - self.snn_accuracy) / gap

    def summary(self, top: int = 5) -> str:
        """A few lines for a person: the gap, the layers that lose most with their cause and
        what addresses it, the T needed."""
        by = {layer.name: layer for layer in self.layers}
        what = "accuracy" if self.labelled else "agreement with the ANN"
        snn = self.snn_accuracy if self.labelled else self.ann_agreement
        lines = [f"at T={self.T} on {self.images} images: SNN {what} {snn:.2f}%"
                 + (f", ANN {self.ann_accuracy:.2f}%" if self.ann_accuracy is not None else "")
                 + f"; mean KL to the ANN {self.kl:.3f}"]
        if self.calibrated_T is not None and self.calibrated_T != self.T:
            lines.append(f"note: the network was calibrated for T={self.calibrated_T}, diagnosed at T={self.T}")
        if self.main:
            rec = self.gap_recovered()
            lines.append(f"the {len(self.main)} of {len(self.layers)} IF layers that lose most, run as "
                         f"their ANN activation, give {self.main_accuracy:.2f}%"
                         + (f" ({100 * rec:.0f}% of the gap recovered)" if rec is not None else ""))
        causes: dict[str, list[str]] = {}
        for name in self.ranking[:top]:
            layer = by[name]
            causes.setdefault(layer.own, []).append(name)
            lines.append(f"  {name} ({layer.site or 'no ANN site'}): departure {layer.departure:.2f} "
                         f"(carried {layer.causes.get('carried', 0):.2f}, clip {layer.causes.get('clip', 0):.2f}, "
                         f"quantisation {layer.causes.get('quantisation', 0):.2f}, temporal "
                         f"{layer.causes.get('temporal', 0):.2f}); as its ANN activation alone: KL to the ANN "
                         f"{-layer.kl_recovered:+.3f}"
                         + (f", accuracy {layer.accuracy_alone:.2f}%" if layer.accuracy_alone is not None else "")
                         + f"; its own largest cause: {layer.own}")
        for cause, names in causes.items():
            lines.append(f"what to do about {cause} ({len(names)} of these layers): {ADVICE[cause]}")
        if self.needed:
            t = self.needed.get("T")
            lines.append(f"the plain conversion (QCFS at L=T, no calibration) reaches the ANN within "
                         f"{self.needed['tolerance']} points at T={t}" if t else
                         f"the plain conversion stays more than {self.needed['tolerance']} points under the "
                         f"ANN up to T={max(map(int, self.needed['curve']))}")
        return "\n".join(lines)


# --- the ANN at the spiking network's sites ---------------------------------------------------

def ann_sites(model: nn.Module, snn: SpikingNetwork, example: torch.Tensor) -> tuple[fx.GraphModule, dict[str, str]]:
    """The caller's ANN traced and rewritten as convert() does before its stages (a copy), and
    for each IF layer of ``snn`` the node of that graph whose output is its ANN activation."""
    from snnconv.constructs.prefix import PREFIX_NAME
    from snnconv.stages.prepare import rewrite_constructs

    gm = prepare(model)
    has_prefix = any(name.split(".")[0] == PREFIX_NAME for name, _ in snn.net.named_modules() if name)
    rewrite_constructs(gm, (example,), maxpool="auto" if has_prefix else "avg")
    nodes = {n.name for n in gm.graph.nodes}
    sources: dict[str, str] = {}
    for name, rec in (snn.meta.get("neurons") or {}).items():
        src = str(rec.get("source", ""))
        node = src[len("qcfs_"):] if src.startswith("qcfs_") else src
        if node in nodes:
            sources[name] = node
    return gm, sources


def _site_function(gm: fx.GraphModule, node_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The site's ANN activation: a ReLU, or a ReLU capped at ``cap`` (a clipped ReLU)."""
    node = next(n for n in gm.graph.nodes if n.name == node_name)
    cap = getattr(module_of(gm, node), "cap", None)
    if cap is None:
        return torch.relu
    return lambda x: torch.clamp(x, 0.0, float(cap))


# --- the neuron's own limits ------------------------------------------------------------------

def site_rates(m: torch.Tensor, unit: IFNeuron, T: int) -> torch.Tensor:
    """``Q_T(m)``: the rate (times theta) the IF neuron ``unit`` reaches in ``T`` steps on the
    constant current ``m`` (``[B, C, ...]``), from its own membrane start, with its own reset.

    Subtractive reset: ``clip(floor(T m / theta + v0), 0, T B) / T * theta`` (B: the most spikes
    it emits in one step, 1 but for a burst neuron). Reset to zero from 0:
    a spike every ``ceil(theta / m)`` steps, ``floor(T / ceil(theta / m)) / T * theta``.
    """
    theta = channel_view(unit.theta.detach().to(m.dtype), m.dim())
    if unit.reset == "zero":
        period = torch.ceil(theta / m.clamp_min(1e-30))
        count = torch.where(m > 0, torch.floor(T / period), torch.zeros_like(m))
    else:
        v0 = channel_view(unit.v_init.to(m.dtype), m.dim())
        count = torch.clamp(torch.floor(m / theta * T + v0), 0, T * unit.burst)
    return count / T * theta


def causes_of(a: torch.Tensor, m: torch.Tensor, r: torch.Tensor, q: torch.Tensor, theta: torch.Tensor,
              f: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The departure ``r - a`` of one IF layer split by cause (they add up to it exactly).

    Args:
        a: the ANN's activation at the site.
        m: the time-mean of the current the neuron receives.
        r: its output rate times theta.
        q: ``Q_T(m)``, :func:`site_rates`.
        theta: its threshold, broadcasting against ``m``.
        f: the site's ANN activation.

    Returns:
        ``{"carried": f(m) - a, "clip": clip(m, 0, theta) - f(m), "quantisation": q - clip(m, 0,
        theta), "temporal": r - q}``.
    """
    clipped = torch.minimum(torch.relu(m), theta)
    fm = f(m)
    return {"carried": fm - a, "clip": clipped - fm, "quantisation": q - clipped, "temporal": r - q}


class _Hooks:
    """Forward hooks on a network's IF layers: per call, each layer's mean input current and
    output rate (in ANN units), and the layers in ``analog`` replaced by their ANN activation.

    The network may run its images in chunks (:attr:`SpikingNetwork.chunk_size`): the values of
    each layer are concatenated in call order."""

    def __init__(self, units: dict[str, IFNeuron], record: bool, analog: dict[str, Callable] | None = None):
        self.units, self.record, self.analog = units, record, analog or {}
        self.mean_in: dict[str, list[torch.Tensor]] = {}
        self.rate: dict[str, list[torch.Tensor]] = {}
        self.handles = [u.register_forward_hook(self._hook(n)) for n, u in units.items()
                        if record or n in self.analog]

    def _hook(self, name: str):
        def hook(mod: IFNeuron, inp, out):
            T = mod.T
            seq = inp[0].detach().reshape(T, -1, *inp[0].shape[1:])
            m = seq.mean(0)
            theta = channel_view(mod.theta.detach().to(m.dtype), m.dim())
            if name in self.analog:
                value = self.analog[name](m)
                rate = value
                new = (value / theta).unsqueeze(0).expand(T, *m.shape).reshape(out.shape).to(out.dtype)
            else:
                rate = out.detach().reshape(T, -1, *out.shape[1:]).mean(0) * theta
                new = None
            if self.record:
                self.mean_in.setdefault(name, []).append(m)
                self.rate.setdefault(name, []).append(rate)
            return new
        return hook

    def take(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        m, r = torch.cat(self.mean_in.pop(name)), torch.cat(self.rate.pop(name))
        return m, r

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def as_ann(snn: SpikingNetwork, x: torch.Tensor, T: int, analog: dict[str, Callable]) -> torch.Tensor:
    """The readout of ``snn`` at ``T`` steps with the IF layers named in ``analog`` run as
    their ANN activation (``analog[name](m)`` on the mean input current ``m``, every step)."""
    hooks = _Hooks(neurons(snn.net), record=False, analog=analog)
    try:
        with torch.no_grad():
            return snn.run(x, T).mean(0)
    finally:
        hooks.remove()


# --- the diagnosis ----------------------------------------------------------------------------

def _batches(data: Any, images: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``images`` inputs of ``data`` (a tensor, or a loader: with their labels where
    every batch has them), drawn without moving the global RNG."""
    from snnconv.pipeline import draw_batches

    if isinstance(data, torch.Tensor):
        return data[:images], None
    batches = draw_batches(data, 10**9, images=images)
    if not batches:
        raise DataError("the diagnosis data is empty: it yielded no batch")
    labels = [y for _, y in batches if y is not None]
    return (torch.cat([x for x, _ in batches])[:images],
            torch.cat(labels)[:images] if len(labels) == len(batches) else None)


def _accuracy(out: torch.Tensor, y: torch.Tensor | None, ann: torch.Tensor) -> float:
    """Accuracy against the labels, or agreement with the ANN's decisions without them (%)."""
    ref = y if y is not None else ann.argmax(1)
    return 100.0 * float((out.argmax(1) == ref.to(out.device)).float().mean())


def diagnose(snn: SpikingNetwork, model: nn.Module, data: Any, *, T: int | None = None,
             images: int = 512, batch_size: int = 128, ablation: bool = True,
             main_share: float = 0.25, analog: Iterable[str] = (), device: torch.device | str = "cpu",
             progress: bool = False) -> Diagnosis:
    """Where ``snn`` (converted from ``model``) departs from ``model`` at ``T`` steps, and what
    each IF layer costs.

    Args:
        snn: the converted :class:`SpikingNetwork` (not changed).
        model: the ANN it was converted from (not changed).
        data: a loader of ``(x, y)`` or bare ``x`` batches, or a tensor of inputs; the first
            ``images`` inputs are used. Without labels, accuracy is agreement with the ANN.
        T: time steps (default: the network's own T).
        images: how many inputs to diagnose on.
        batch_size: images per forward.
        ablation: measure what each layer costs (one forward of the network per IF layer, and
            a few more for the main layers together); ``False`` gives the departures only.
        main_share: the main layers are at most this share of the IF layers.
        analog: IF layers (names as in ``snn.meta["neurons"]``) run as their ANN activation
            throughout: what the network would do without their own error.
        device: where to compute.
        progress: a line per stage of the work on stderr.

    Returns:
        a :class:`Diagnosis`.

    Raises:
        ConfigError: ``T`` or ``main_share`` out of range, or an unknown layer in ``analog``.
        DataError: no data.
    """
    import sys

    T = snn.T if T is None else T
    check_T(T)
    T = int(T)
    if not 0 < main_share <= 1:
        raise ConfigError(f"main_share must be in (0, 1], got {main_share}")
    start = time.perf_counter()
    device = torch.device(device)
    say = (lambda msg: print(f"diagnose: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    x_all, y_all = _batches(data, images)
    snn = copy.deepcopy(snn).to(device).eval()
    model = copy.deepcopy(model).to(device).eval()
    gm, sources = ann_sites(model, snn, x_all[:1].to(device))
    units = neurons(snn.net)
    site_fn = {n: _site_function(gm, sources[n]) for n in units if n in sources}
    analog_fn = {n: site_fn.get(n, torch.relu) for n in units}
    analog = list(analog)
    unknown = sorted(set(analog) - set(units))
    fixed = {n: analog_fn[n] for n in analog if n in analog_fn}
    if unknown:
        raise ConfigError(f"analog names no IF layer of the network: {', '.join(unknown)}; its IF layers "
                          f"are {', '.join(units)}")
    sums: dict[str, dict[str, float]] = {n: {c: 0.0 for c in (*CAUSES, "total", "own", "ann")} for n in units}
    counts: dict[str, int] = {n: 0 for n in units}
    ch_ann: dict[str, torch.Tensor] = {}
    ch_snn: dict[str, torch.Tensor] = {}
    ch_sat: dict[str, torch.Tensor] = {}
    spikes: dict[str, float] = {n: 0.0 for n in units}
    ann_out, snn_out = [], []
    say(f"{len(units)} IF layers, {len(x_all)} images at T={T}")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for lo in range(0, len(x_all), batch_size):
            x = x_all[lo:lo + batch_size].to(device)
            values, out = capture(gm, (x,), set(sources.values()), with_output=True)
            ann_out.append(out)
            hooks = _Hooks(units, record=True, analog=fixed)
            try:
                snn_out.append(snn.run(x, T).mean(0))
            finally:
                hooks.remove()
            for name, unit in units.items():
                m, r = hooks.take(name)
                theta = channel_view(unit.theta.detach().to(m.dtype), m.dim())
                top = theta * unit.burst  # the most a neuron emits per step
                spikes[name] += float((r / theta).sum())
                sat = (r >= top * (1 - 1e-6)).flatten(2).all(2).all(0) if r.dim() > 2 else (
                    r >= top * (1 - 1e-6)).all(0)
                ch_sat[name] = sat if name not in ch_sat else ch_sat[name] & sat
                ch_snn[name] = ch_snn.get(name, 0) + channel_sums(r)
                counts[name] += r.numel()
                if name not in sources:
                    continue
                a = values[sources[name]]
                f = site_fn[name]
                q = site_rates(m, unit, T)
                parts = causes_of(a, m, r, q, top, f)
                parts.update(total=r - a, own=r - f(m), ann=a)
                for c, v in parts.items():
                    sums[name][c] += float(v.double().pow(2).sum())
                ch_ann[name] = ch_ann.get(name, 0) + channel_sums(a)
    ann_o, snn_o = torch.cat(ann_out), torch.cat(snn_out)
    kl = kl_to(ann_o, snn_o)
    layers = []
    for name in units:
        s, n = sums[name], max(1, counts[name])
        ref = math.sqrt(s["ann"] / n) or 1.0
        channels = int(ch_snn[name].numel())
        silent = ch_snn[name] == 0
        dead = int((silent & (ch_ann[name] > 0)).sum()) if name in ch_ann else int(silent.sum())
        layers.append(LayerDiagnosis(
            name=name, site=sources.get(name), units=counts[name] // len(x_all), channels=channels,
            departure=math.sqrt(s["total"] / n) / ref if name in sources else float("nan"),
            own_departure=math.sqrt(s["own"] / n) / ref if name in sources else float("nan"),
            causes={c: math.sqrt(s[c] / n) / ref for c in CAUSES} if name in sources else {},
            dead_channels=dead, saturated_channels=int(ch_sat[name].sum()),
            firing_rate=spikes[name] / n / T))
    diag = Diagnosis(T=T, images=len(x_all), labelled=y_all is not None,
                     ann_accuracy=_accuracy(ann_o, y_all, ann_o) if y_all is not None else None,
                     snn_accuracy=_accuracy(snn_o, y_all, ann_o),
                     ann_agreement=100.0 * float((snn_o.argmax(1) == ann_o.argmax(1)).float().mean()),
                     kl=float(kl.mean()), layers=layers,
                     calibrated_T=snn.meta.get("calibrated_T") if isinstance(snn.meta, dict) else None)
    if ablation:
        _ablate(diag, snn, x_all, y_all, ann_o, analog_fn, fixed, T, batch_size, device, main_share, say)
    diag.seconds = time.perf_counter() - start
    return diag


def _ablate(diag: Diagnosis, snn: SpikingNetwork, x_all: torch.Tensor, y: torch.Tensor | None,
            ann_o: torch.Tensor, analog_fn: dict[str, Callable], fixed: dict[str, Callable], T: int,
            batch_size: int, device: torch.device, main_share: float, say: Callable[[str], None]) -> None:
    """Each layer alone as its ANN activation, then the top k together (k = 1, 2, 4, ... up to
    ``main_share`` of the layers, stopping at the first that recovers half of the gap): the
    ranking, the main layers (that first k, else the k that recovered most) and the accuracy
    they recover."""

    def run(names: Sequence[str]) -> torch.Tensor:
        fns = dict(fixed, **{n: analog_fn[n] for n in names})
        return torch.cat([as_ann(snn, x_all[lo:lo + batch_size].to(device), T, fns)
                          for lo in range(0, len(x_all), batch_size)])

    base_kl = diag.kl
    last = time.perf_counter()
    for i, layer in enumerate(diag.layers):
        out = run([layer.name])
        layer.kl_recovered = base_kl - float(kl_to(ann_o, out).mean())
        layer.accuracy_alone = _accuracy(out, y, ann_o)
        if time.perf_counter() - last > 5:
            say(f"layer {i + 1}/{len(diag.layers)} run as its ANN activation")
            last = time.perf_counter()
    diag.ranking = [layer.name for layer in sorted(diag.layers, key=lambda lay: -lay.kl_recovered)]
    most = max(1, int(main_share * len(diag.layers)))
    ks = sorted({min(k, most) for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, most)})
    target = None if diag.ann_accuracy is None else (diag.snn_accuracy or 0.0) + 0.5 * (
        diag.ann_accuracy - (diag.snn_accuracy or 0.0))
    for k in ks:
        acc = _accuracy(run(diag.ranking[:k]), y, ann_o)
        diag.recovered[str(k)] = acc
        say(f"the top {k} layer(s) as ANN activations: {acc:.2f}%")
        if target is not None and acc >= target:
            break
    # the first k that recovers half of the gap, else the k that recovered most (the smaller on a tie)
    best_k = next((k for k in map(int, diag.recovered) if target is not None and diag.recovered[str(k)] >= target),
                  max(map(int, diag.recovered), key=lambda k: (diag.recovered[str(k)], -k)))
    diag.main = diag.ranking[:best_k]
    diag.main_accuracy = diag.recovered[str(best_k)]


def needed_T(model: nn.Module, loader: Any, data: Any, *, Ts: Iterable[int] = (4, 8, 16, 32, 64, 128, 256),
             tolerance: float = 1.0, images: int = 512, batch_size: int = 128, calib_batches: int = 10,
             device: torch.device | str = "cpu", progress: bool = False) -> dict[str, Any]:
    """The plain conversion's accuracy at each T of ``Ts`` (QCFS at L = T on the folded ANN,
    thresholds from ``calib_batches`` batches of ``loader``, IF neurons, no calibration after),
    stopping at the first T within ``tolerance`` points of the ANN: ``{"T": that T or None,
    "curve": {T: accuracy}, "ann": accuracy, "tolerance": tolerance}``."""
    import sys

    from snnconv.pipeline import convert, draw_batches

    x_all, y_all = _batches(data, images)
    device = torch.device(device)
    batches = draw_batches(loader, calib_batches)
    model = copy.deepcopy(model).to(device).eval()
    with torch.no_grad():
        ann_o = torch.cat([model(x_all[lo:lo + batch_size].to(device)) for lo in range(0, len(x_all), batch_size)])
    ann = _accuracy(ann_o, y_all, ann_o)
    curve: dict[str, float] = {}
    found = None
    for t in Ts:
        check_T(t)
        s, _ = convert(model, batches, T=int(t), L=int(t), calib_batches=len(batches), finetune_epochs=0,
                       qcfs_epochs=0, bias_calibration=False, threshold_calibration=False,
                       reconstruction_steps=0, device=device, progress=False, on_collapse="warn")
        with torch.no_grad():
            out = torch.cat([s(x_all[lo:lo + batch_size].to(device)) for lo in range(0, len(x_all), batch_size)])
        curve[str(t)] = _accuracy(out, y_all, ann_o)
        if progress:
            print(f"diagnose: the plain conversion at T={t}: {curve[str(t)]:.2f}% (ANN {ann:.2f}%)",
                  file=sys.stderr, flush=True)
        if curve[str(t)] >= ann - tolerance:
            found = int(t)
            break
    return {"T": found, "curve": curve, "ann": ann, "tolerance": tolerance}
