"""Per-layer activity after each stage, and the checks that refuse a collapsed conversion.

A stage can leave a network that runs but computes nothing: a QCFS site whose threshold sits
above every input (silent), one whose every output sits at the clip (saturated), an SNN whose
deep layers never fire at the chosen T, or a whole network at chance. :func:`activity` measures
each activation site on a few calibration batches; :func:`collapse_report` names the sites
that are silent or saturated on all of them, and whether the network is at chance while the
original ANN is not. ``convert()`` records both in ``meta`` after every stage and raises
:class:`~snnconv.errors.ConversionError` (or warns, with ``on_collapse="warn"``).

Activity measures, per site, over every element (sample x neuron) of the batches:

- ``active``: the fraction of elements with a non-zero output (for an IF neuron: at least one
  spike in T steps);
- ``saturated``: the fraction at the largest output the site can give (QCFS: lambda; IF: a
  spike at every step); ``None`` for a ReLU, which has no largest output;
- ``mean``: the mean output in units of the site's range (QCFS: ``a / lambda``; IF: spikes
  per step; ReLU: the raw mean).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.graph import capture, module_of

__all__ = ["activity", "collapse_report", "dead_layers", "accuracy_of", "chance_level"]


def _relu_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    from snnconv.activation import relu_sites

    return relu_sites(gm)


def activity(model: nn.Module, batches: list[torch.Tensor],
             outputs: list[torch.Tensor] | None = None) -> dict[str, dict[str, Any]]:
    """Per-site activity of ``model`` (a traced ANN with ReLU or QCFS, or a SpikingNetwork), in
    eval mode; the model's output for each batch is appended to ``outputs`` where given (one
    pass gives both, see :func:`accuracy_of`)."""
    from snnconv.activation import QCFS
    from snnconv.snn.network import SpikingNetwork
    from snnconv.snn.neuron import IFNeuron, channel_view

    sums: dict[str, list[float]] = {}

    def add(name: str, active, saturated, mean, n: int) -> None:
        s = sums.setdefault(name, [0.0, 0.0, 0.0, 0, saturated is not None])
        s[0] += float(active) * n
        s[1] += float(saturated) * n if saturated is not None else 0.0
        s[2] += float(mean) * n
        s[3] += n

    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if isinstance(model, SpikingNetwork):
                handles = []
                for name, m in model.net.named_modules():
                    if isinstance(m, IFNeuron):
                        def hook(mod, inp, out, name=name):
                            counts = out.reshape(mod.T, -1, *out.shape[1:]).sum(0)
                            add(name, (counts > 0).float().mean(), (counts >= mod.T).float().mean(),
                                counts.float().mean() / mod.T, counts.numel())
                        handles.append(m.register_forward_hook(hook))
                try:
                    for x in batches:
                        out = model(x)  # one T-step pass (the network's own T, in its chunks)
                        if outputs is not None:
                            outputs.append(out)
                finally:
                    for h in handles:
                        h.remove()
            else:
                gm = cast(fx.GraphModule, model)
                qcfs = {n.name: m for n in gm.graph.nodes if isinstance(m := module_of(gm, n), QCFS)}
                names = set(qcfs) | {n.name for n in _relu_nodes(gm)}
                # QCFS sites by module name; ReLU sites by fx node name (calibrate_qcfs names the
                # QCFS of ReLU node ``n`` "qcfs_n")
                labels = {n.name: (str(n.target) if n.name in qcfs else n.name) for n in gm.graph.nodes
                          if n.name in names}
                for x in batches:
                    values, out = capture(gm, (x,), names, with_output=True)
                    if outputs is not None:
                        outputs.append(out)
                    for node, v in values.items():
                        v = v.detach().float()
                        q = qcfs.get(node)
                        if q is not None:
                            lam = channel_view(q.lam.detach().float(), v.dim())
                            add(labels[node], (v > 0).float().mean(), (v >= lam * (1 - 1e-6)).float().mean(),
                                (v / lam).mean(), v.numel())
                        else:
                            add(labels[node], (v > 0).float().mean(), None, v.mean(), v.numel())
    finally:
        model.train(was)
    return {name: {"active": s[0] / s[3], "saturated": s[1] / s[3] if s[4] else None, "mean": s[2] / s[3]}
            for name, s in sums.items()}


def accuracy_of(outputs: list[torch.Tensor], labels: list[torch.Tensor]) -> float | None:
    """Top-1 accuracy (percent) of a model's ``outputs`` on labelled batches; ``None`` without labels."""
    if not labels or any(y is None for y in labels):
        return None
    correct = sum((out.argmax(1).cpu() == y.cpu()).sum().item() for out, y in zip(outputs, labels))
    return 100.0 * correct / max(sum(len(y) for y in labels), 1)


def chance_level(labels: list[torch.Tensor]) -> float | None:
    """The accuracy (percent) of always answering the most frequent label."""
    if not labels or any(y is None for y in labels):
        return None
    y = torch.cat([t.reshape(-1).cpu() for t in labels])
    if y.is_floating_point() or y.numel() == 0:
        return None
    return 100.0 * torch.bincount(y.long().clamp_min(0)).max().item() / y.numel()


#: A network is "at chance" when its accuracy is within this many points of the majority
#: class, while the ANN is at least :data:`WORKING_MARGIN` points above it.
CHANCE_MARGIN = 5.0
WORKING_MARGIN = 25.0


def collapse_report(act: dict[str, dict[str, Any]], *, reference: dict[str, dict[str, Any]] | None = None,
                    source: dict[str, str] | None = None, accuracy: float | None = None,
                    ann_accuracy: float | None = None, chance: float | None = None) -> list[str]:
    """Human-readable findings: sites the stage made silent or saturated, a network at chance.

    ``reference`` is the ANN's activity (by ReLU node name) and ``source`` maps a site of
    ``act`` to its ReLU node name: a site that is silent because its ReLU was already dead in
    the ANN is not a collapse of the conversion (the ANN's own dead layers are reported by
    :func:`dead_layers`). Without a reference every silent site counts. Empty: healthy.
    """
    found = []
    reference, source = reference or {}, source or {}

    def was_alive(name: str) -> bool:
        ref = reference.get(source.get(name, name))
        return ref is None or ref["active"] > 0

    silent = [n for n, a in act.items() if a["active"] == 0.0 and was_alive(n)]
    saturated = [n for n, a in act.items() if a["saturated"] is not None and a["saturated"] >= 1.0]
    if silent:
        found.append(f"silent (no output above zero on any calibration sample, where the ANN's "
                     f"ReLU was active): {', '.join(silent)}")
    if saturated:
        found.append(f"saturated (at its largest output on every calibration sample): {', '.join(saturated)}")
    if (accuracy is not None and ann_accuracy is not None and chance is not None
            and ann_accuracy >= chance + WORKING_MARGIN and accuracy <= chance + CHANCE_MARGIN):
        found.append(f"at chance: {accuracy:.1f}% on the calibration batches (majority class "
                     f"{chance:.1f}%) where the ANN reaches {ann_accuracy:.1f}%")
    return found


def dead_layers(act: dict[str, dict[str, Any]]) -> list[str]:
    """ReLU sites of an ANN that output zero on every calibration sample."""
    return [n for n, a in act.items() if a["active"] == 0.0]
