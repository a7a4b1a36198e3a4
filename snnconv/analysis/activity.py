"""What a converted SNN does while it runs: firing rates, synaptic operations, energy, rasters.

    stats = snnconv.analysis.activity.analyse(snn, x, T=8)
    stats.firing_rate            # {neuron layer: spikes / (neurons * T * B)}
    stats.synops, stats.macs     # {weight layer: synaptic events over the run / MACs of the ANN}
    stats.energy()               # a 45 nm estimate (pJ per inference), SNN against the ANN
    record = snnconv.analysis.activity.evaluation_record(snn, test_loader, [1, 2, 4, 8])  # evaluation.json

Counting convention (the backends' own, so that ``evaluate`` and ``snnconv run --backend cpu``
print the same figure for the same images):

- a spike does one accumulate (AC) per outgoing synapse of the weighted layer (Conv, Linear, or
  an identity shortcut's Scale: one add) it reaches through pooling (a window's spikes are
  summed, not averaged), flattening, adds and concatenations: ``synops`` is that count over the
  run, exactly (all-one weights applied to the spike pattern);
- a weight layer that sees only the static input (direct encoding; the analog prefix too) does
  multiply-accumulates (MACs) once per image (``static_macs``); one fed by another analog value
  (a layer after a Conv that no neuron follows) does MACs at every step (``dense_macs``);
- ``macs`` is what the ANN does in the same layer for the same batch (per image x B, once).

Energy per operation: :data:`~snnconv.analysis.energy.E_MAC_PJ` per 32-bit float MAC and
:data:`~snnconv.analysis.energy.E_AC_PJ` per AC (45 nm CMOS, Horowitz, ISSCC 2014); the ANN's MACs are
its synapses (:func:`~snnconv.analysis.energy.conv_macs`: padding excluded), and energies compare as
SNN / ANN. It is an estimate of
arithmetic only (no memory traffic, no routing); a backend that models a chip reports its own
numbers in ``RunResult.extra``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from snnconv.analysis.energy import E_AC_PJ, E_MAC_PJ, arithmetic_energy, conv_macs, linear_macs
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.data import first_batch
from snnconv.progress import progress_bar
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import IFNeuron, LeakyNeuron, Scale, neurons
from snnconv.snn.timing import AnalogPrefix

__all__ = ["SpikeAnalysis", "analyse", "static_macs", "evaluation_record", "backend_record", "E_MAC_PJ",
           "E_AC_PJ",
           "RASTER_NEURONS", "ANALYSIS_IMAGES"]

RASTER_NEURONS = 64
#: Images of the first test batch that :func:`evaluation_record` analyses.
ANALYSIS_IMAGES = 64

_WEIGHT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


@dataclass(frozen=True)
class SpikeAnalysis:
    """Activity of one SNN run on one batch (plain Python data, JSON-ready).

    Attributes:
        T, batch: time steps and batch size of the run.
        neurons: neuron layer -> number of neurons per image.
        spikes_per_step: neuron layer -> spikes at each step, summed over batch and neurons.
        firing_rate: neuron layer -> spikes / (neurons * T * batch), in [0, 1].
        synops: weight layer -> accumulates over the run (spike-driven layers).
        static_macs: weight layer -> MACs of layers that see the static input (once per image).
        dense_macs: weight layer -> MACs over the run of layers fed by another analog value
            (at every step).
        macs: weight layer -> MACs of the same layer in the ANN for the batch.
        raster: neuron layer -> spike times of the first ``RASTER_NEURONS`` neurons of image 0,
            a list of ``[step, neuron index]`` pairs.
    """

    T: int
    batch: int
    neurons: dict[str, int]
    spikes_per_step: dict[str, list[float]]
    firing_rate: dict[str, float]
    synops: dict[str, float]
    static_macs: dict[str, float]
    macs: dict[str, float]
    raster: dict[str, list[list[int]]] = field(default_factory=dict)
    dense_macs: dict[str, float] = field(default_factory=dict)

    def energy(self) -> dict[str, Any]:
        """The arithmetic comparison per image (:func:`snnconv.analysis.energy.arithmetic_energy`)."""
        return arithmetic_energy(synops=sum(self.synops.values()),
                                 analog_macs=sum(self.static_macs.values()) + sum(self.dense_macs.values()),
                                 ann_macs=sum(self.macs.values()), images=self.batch)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, with the energy estimate added under ``"energy"``."""
        data = asdict(self)
        data["energy"] = self.energy()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpikeAnalysis":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def _structural(layer: Any, events: torch.Tensor) -> torch.Tensor:
    """ACs of ``layer`` for spike events ``events``: the layer with all-one weights, summed."""
    if isinstance(layer, nn.Linear):
        return events.sum() * layer.out_features
    if layer.padding_mode != "zeros":
        raise ValueError(f"synaptic operation counts need zero padding; {type(layer).__name__} "
                         f"uses padding_mode={layer.padding_mode!r}")
    conv = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[type(layer)]
    ones = torch.ones_like(layer.weight, dtype=events.dtype)
    return conv(events, ones, None, layer.stride, layer.padding, layer.dilation, layer.groups).sum()


def _summed(mod: Any, events: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A pooling of spike events as a sum over each window (a spike reaches every window it is in)."""
    if isinstance(mod, nn.AvgPool2d):
        return F.avg_pool2d(events, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode,
                            mod.count_include_pad, divisor_override=1)
    if isinstance(mod, nn.AvgPool1d):
        return F.avg_pool1d(events, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode,
                            mod.count_include_pad) * mod.kernel_size[0]  # type: ignore[index]  # stored as (k,)
    windows = torch.tensor(events.shape[2:]).prod() / torch.tensor(out.shape[2:]).prod()
    return F.adaptive_avg_pool2d(events, out.shape[2:]) * windows  # type: ignore[arg-type]  # AdaptiveAvgPool2d


_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)


def _carried_scales(gm: fx.GraphModule) -> set[str]:
    """Names of the ``Scale`` nodes whose output reaches a weight layer through ops that are
    neither weight layers nor neurons (a concatenation, a flatten, a pooling): the weight layer
    takes the scale into its weights and counts their spikes, as every backend does
    (``snnconv_backends.engine.stats``); a Scale that reaches only neurons (an identity
    shortcut) is one add per spike."""
    def kind(n: fx.Node) -> str:
        if n.op == "output":
            return "stop"
        if n.op != "call_module":
            return "pass"
        m = gm.get_submodule(str(n.target))
        if isinstance(m, Scale):
            return "scale"
        if isinstance(m, _WEIGHT_LAYERS):
            return "weight"
        return "stop" if isinstance(m, (IFNeuron, LeakyNeuron, AnalogPrefix)) else "pass"
    reaches: set[str] = set()
    for n in reversed(list(gm.graph.nodes)):
        if any(kind(u) == "weight" or (kind(u) in ("pass", "scale") and u.name in reaches) for u in n.users):
            reaches.add(n.name)
    return {n.name for n in gm.graph.nodes if kind(n) == "scale" and n.name in reaches}


class _Counter(fx.Interpreter):
    """Run the network once and count, per weight layer, what the backends count (module docstring)."""

    def __init__(self, gm: fx.GraphModule, T: int, B: int):
        super().__init__(gm)
        self.T, self.B = T, B
        self.events: dict[str, torch.Tensor | None] = {}  # spikes reaching a node (None: analog)
        self.static: dict[str, bool] = {}                   # depends on no neuron
        self.synops: dict[str, float] = {}
        self.static_macs: dict[str, float] = {}
        self.dense_macs: dict[str, float] = {}
        self.macs: dict[str, float] = {}
        self.carried = _carried_scales(gm)

    def _layer(self, name: str, layer: nn.Module, x: torch.Tensor, events, static: bool) -> None:
        per_image = _macs_per_image(layer, x) if not isinstance(layer, Scale) else 0.0
        if events is not None:
            fan = events.sum() if isinstance(layer, Scale) else _structural(layer, events)
            self.synops[name] = self.synops.get(name, 0.0) + float(fan)
        elif static:
            self.static_macs[name] = per_image * self.B
        elif not isinstance(layer, Scale):
            self.dense_macs[name] = per_image * self.B * self.T
        if not isinstance(layer, Scale):
            self.macs[name] = per_image * self.B

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        ins = [a for a in n.all_input_nodes if a.name in self.static]
        static = all(self.static[a.name] for a in ins)
        events = [self.events.get(a.name) for a in ins]
        spiking = [e for e in events if e is not None]
        ev = None
        mod = self.module.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(mod, (IFNeuron, LeakyNeuron)):
            static = False
            if getattr(mod, "kind", "if") != "li":
                ev = (out.detach() != 0).to(torch.float32)
        elif isinstance(mod, AnalogPrefix):
            self._prefix(str(n.target), mod, self.fetch_args_kwargs_from_env(n)[0][0])
        elif isinstance(mod, Scale) and n.name in self.carried:
            ev = spiking[0] if spiking else None  # folded into the weight layer after it
        elif isinstance(mod, _WEIGHT_LAYERS + (Scale,)):
            x = self.fetch_args_kwargs_from_env(n)[0][0]
            self._layer(str(n.target), mod, x, events[0] if events else None, static)
        elif isinstance(mod, _POOLS) and spiking:
            ev = _summed(mod, spiking[0], out)
        elif spiking and isinstance(out, torch.Tensor) and n.op != "output":
            # flatten, add, concatenation, TimeExpand, Dropout / Identity: the op on the events
            def spikes_of(a: fx.Node) -> Any:  # an analog operand (a static shortcut) adds none
                e, v = self.events.get(a.name), self.env[a]
                return e if e is not None else torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            args, kwargs = fx.node.map_arg(n.args, spikes_of), fx.node.map_arg(n.kwargs, spikes_of)
            ev = getattr(self, n.op)(n.target, args, kwargs)
        if n.op == "placeholder":
            static = True
        self.static[n.name], self.events[n.name] = static, ev
        return out

    def _prefix(self, target: str, prefix: nn.Module, x: torch.Tensor) -> None:
        """The analog prefix's layers: MACs once per image on both sides."""
        for name, m in static_macs(prefix, x).items():
            self.static_macs[f"{target}.{name}"] = self.macs[f"{target}.{name}"] = m


def static_macs(module: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """MACs of every weight layer of ``module`` (an analog prefix, run once per image) on the
    batch ``x``: what the arithmetic comparison charges it on both sides."""
    macs: dict[str, float] = {}
    handles = []
    for name, m in module.named_modules():
        if isinstance(m, _WEIGHT_LAYERS):
            def hook(mod, inp, key=name):
                macs[key] = _macs_per_image(mod, inp[0]) * int(inp[0].shape[0])
            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            module(x)
    finally:
        for h in handles:
            h.remove()
    return macs


def _macs_per_image(layer: Any, x: torch.Tensor) -> float:
    """Multiply-accumulates of ``layer`` for one image of the shape of ``x[0]``: its synapses
    (:func:`snnconv.analysis.energy.conv_macs`, the count every backend reports too)."""
    if isinstance(layer, nn.Linear):
        return float(linear_macs(tuple(layer.weight.shape)))
    padding = layer.padding
    if isinstance(padding, str):  # "valid" or "same" (torch pads the odd remainder after)
        total = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size)]
        padding = [(0, 0) if layer.padding == "valid" else (t // 2, t - t // 2) for t in total]
    return float(conv_macs(tuple(x.shape[1:]), tuple(layer.weight.shape), layer.stride, padding,
                           layer.dilation))


def analyse(snn: SpikingNetwork, x: torch.Tensor, T: int | None = None, *,
            raster_neurons: int = RASTER_NEURONS) -> SpikeAnalysis:
    """Run ``snn`` on the static batch ``x`` for ``T`` steps and count what it does.

    Args:
        snn: a converted network.
        x: ``[B, ...]`` inputs (direct encoding: the same input at every step).
        T: steps (default ``snn.T``).
        raster_neurons: how many neurons of each layer (image 0) to record spike times for.

    Returns:
        A :class:`SpikeAnalysis`.

    Raises:
        TypeError: ``snn`` is not a :class:`SpikingNetwork`.
    """
    if not isinstance(snn, SpikingNetwork):
        raise TypeError(f"analyse() expects a SpikingNetwork, got {type(snn).__name__}")
    T = snn.T if T is None else T
    check_T(T)
    T, B = int(T), int(x.shape[0])
    counts: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    raster: dict[str, list[list[int]]] = {}
    handles = []

    def on_spikes(name):
        def hook(mod: IFNeuron, inp, out):
            s = out.detach().reshape(T, B, -1)
            sizes[name] = s.shape[2]
            counts[name] = s.sum(dim=(1, 2))
            first = s[:, 0, :raster_neurons].nonzero().tolist()
            raster[name] = [[int(t), int(i)] for t, i in first]
        return hook

    for name, m in neurons(snn.net).items():
        handles.append(m.register_forward_hook(on_spikes(name)))
    counter = _Counter(snn.net, T, B)
    old_T, was = snn.T, snn.training
    snn.eval()
    snn.T = T
    try:
        with torch.no_grad():
            counter.run(x)
    finally:
        snn.T = old_T
        snn.train(was)
        for h in handles:
            h.remove()
    synops, static, macs = counter.synops, counter.static_macs, counter.macs
    firing = {n: float(c.sum()) / (sizes[n] * T * B) for n, c in counts.items()}
    return SpikeAnalysis(T=T, batch=B, neurons=sizes,
                         spikes_per_step={n: [float(v) for v in c] for n, c in counts.items()},
                         firing_rate=firing, synops=synops, static_macs=static, macs=macs,
                         raster=raster, dense_macs=counter.dense_macs)


def evaluation_record(snn: SpikingNetwork, loader: Iterable, Ts: Sequence[int], *,
                      device: torch.device | str = "cpu", label: str = "snn",
                      progress: bool = True) -> dict[str, Any]:
    """Accuracy at every T over ``loader`` and the spike statistics of its first batch.

    This is what ``evaluation.json`` of a run folder holds (``snnconv evaluate``).

    Args:
        snn: a converted network, already on ``device``.
        loader: a labelled loader (the test split).
        Ts: the time steps to measure accuracy at; the analysis runs at the largest.
        device: where the batches go.
        label: the network's name in the record (a file name, say).
        progress: show a progress bar over the batches.

    Returns:
        ``{"network": label, "accuracy": {str(T): percent}, "analysis": SpikeAnalysis as data}``,
        the analysis of the first :data:`ANALYSIS_IMAGES` images of the first batch.

    Raises:
        DataError: ``loader`` yields nothing, or batches without labels.
    """
    batches = progress_bar(loader, desc=f"evaluate T<={max(Ts)}", disable=not progress, leave=False)
    acc = accuracy_by_T(snn, batches, Ts, device)
    x, _ = first_batch(loader, where="the test loader")
    with torch.no_grad():
        stats = analyse(snn, x[:ANALYSIS_IMAGES].to(device), T=max(Ts))
    return {"network": label, "accuracy": {str(t): a for t, a in acc.items()},
            "analysis": stats.to_dict()}


def _plain(obj: Any) -> Any:
    """JSON-ready copy: tensors and arrays as lists, other objects as strings."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() <= 4096 else f"tensor{tuple(obj.shape)}"
    if hasattr(obj, "tolist") and hasattr(obj, "size"):  # numpy
        return obj.tolist() if obj.size <= 4096 else f"array{tuple(obj.shape)}"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _energy_nj(extra: Mapping[str, Any], batch: int) -> float | None:
    """A backend's energy per image in nJ, from the keys a backend may report."""
    energy = extra.get("energy")
    if not isinstance(energy, Mapping):
        return None
    energy = {str(k).lower(): v for k, v in energy.items()}  # per_image_J, per_image_j, ...
    for key, scale in (("per_image_nj", 1.0), ("energy_per_image_nj", 1.0), ("per_image_j", 1e9),
                       ("per_image_uj", 1e3), ("per_image_pj", 1e-3)):
        if isinstance(energy.get(key), (int, float)):
            return float(energy[key]) * scale
    for key, scale in (("total_j", 1e9), ("total_nj", 1.0), ("total_uj", 1e3), ("total_pj", 1e-3)):
        if isinstance(energy.get(key), (int, float)):
            return float(energy[key]) * scale / batch
    return None


def backend_record(name: str, result: Any, labels: torch.Tensor, reference: torch.Tensor, *,
                   T: int, wall_s: float) -> dict[str, Any]:
    """One backend run as JSON-ready data (``backends/NAME.json`` of a run folder).

    Args:
        name: the backend's name.
        result: its ``RunResult`` (``outputs`` ``[T, B, classes]``, ``synops``, ``macs``, ``extra``).
        labels: ``[B]`` true classes.
        reference: ``[B]`` the torch SpikingNetwork's predictions for the same images and T.
        T, wall_s: steps run and the wall time of compile + run.

    Returns:
        ``backend``, ``T``, ``images``, ``accuracy`` and ``agreement`` (percent),
        ``synops_total``, ``macs_total``, ``energy_per_image_nj`` (when the backend reports
        energy), ``wall_s`` and ``extra`` (the backend's own report).
    """
    outputs = torch.as_tensor(result.outputs)
    if outputs.dim() < 3 or outputs.shape[1] != len(labels):
        raise ValueError(f"backend {name} returned outputs of shape {tuple(outputs.shape)}; expected "
                         f"[T, {len(labels)}, classes]")
    pred = outputs.float().mean(0).argmax(1).cpu()
    extra = dict(getattr(result, "extra", {}) or {})
    record = {
        "backend": name, "T": int(T), "images": int(len(labels)),
        "accuracy": 100.0 * (pred == labels.cpu()).float().mean().item(),
        "agreement": 100.0 * (pred == reference.cpu()).float().mean().item(),
        "synops_total": float(sum(float(v) for v in (result.synops or {}).values())),
        "macs_total": float(sum(float(v) for v in (result.macs or {}).values())),
        "wall_s": float(wall_s),
        "extra": _plain(extra),
    }
    energy = _energy_nj(extra, len(labels))
    if energy is not None:
        record["energy_per_image_nj"] = energy
    return record
