"""The spiking network's residual error at each QCFS site, the noise of noise-modelled QCFS
training (Hu et al., arXiv 2404.17456): per site, the standard deviation of what the QCFS-ANN's
site computes minus the converted network's ``theta * spike rate`` over T steps."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.fx as fx

from snnconv.activation import QCFS
from snnconv.graph import capture, capture_pieces, module_of
from snnconv.snn.neuron import IFNeuron, channel_view
from snnconv.stages.spiking import to_spiking

__all__ = ["residual_noise"]


def residual_noise(qgm: fx.GraphModule, batches: list[torch.Tensor], *, T: int,
                   reset: str = "subtract", local: bool = True) -> dict[str, float]:
    """Per QCFS call site of ``qgm`` (its fx node name): the residual error's standard deviation.

    ``qgm`` is converted (a copy: :func:`snnconv.stages.spiking.to_spiking` at ``T`` steps and
    ``reset``) and run on each batch of ``batches``, in pieces of images that fit the memory
    (:func:`snnconv.graph.capture_pieces`). Per batch, the variance over every output element
    of the site's error; the result is the square root of its mean over the batches.

    ``local=True`` (default): the error the layer itself adds, ``QCFS(mean_t I_t) - theta *
    rate``, with ``I_t`` the current the IF neuron receives from the spiking layers before it:
    what the site's QCFS makes of the mean of that input, against what the neuron fires on
    it. Injected at every site during training, the errors of earlier layers reach a later
    one through the forward pass itself. ``local=False``: the reference's model (Hu et al.),
    ``QCFS(z_ann) - theta * rate(z_snn)`` with each network run from the input, which counts an
    earlier layer's error again at every later site; as the noise of QCFS training on the
    matrix's ResNet-20 (Fashion-MNIST, L=T=4, three epochs) it held the training accuracy at
    11-23% (benchmarks/README.md, "Levers for few steps").
    """
    was_training = qgm.training
    qgm.eval()
    try:
        snn = to_spiking(qgm, T=T, reset=reset)
        sources: dict[str, list[str]] = {}
        for node in qgm.graph.nodes:
            if node.op == "call_module" and isinstance(module_of(qgm, node), QCFS):
                sources.setdefault(str(node.target), []).append(node.name)
        neurons: dict[str, list[fx.Node]] = {}
        targets = {name: rec["source"] for name, rec in snn.meta["neurons"].items()}
        for node in snn.net.graph.nodes:
            if node.op == "call_module" and str(node.target) in targets:
                neurons.setdefault(targets[str(node.target)], []).append(node)
        # the k-th call of a QCFS module is the k-th call of the neuron that replaced it: per
        # pair the site's node name, the neuron's node and its input's, the QCFS, the neuron
        pairs = [(a, s.name, cast(fx.Node, s.args[0]).name, cast(QCFS, qgm.get_submodule(target)),
                  cast(IFNeuron, module_of(snn.net, s)))
                 for target, calls in sources.items() for a, s in zip(calls, neurons.get(target, []))]
        variances: dict[str, list[float]] = {p[0]: [] for p in pairs}
        wanted = [p[1] for p in pairs] + ([p[2] for p in pairs] if local else [])
        for x in batches:
            # per site the error's count, sum and sum of squares over the pieces that fit the memory
            sums = {p[0]: [0, 0.0, 0.0] for p in pairs}
            for lo, hi, seen in capture_pieces(snn.net, x, wanted):
                ann = {} if local else capture(qgm, (x[lo:hi],), [p[0] for p in pairs])
                for a, s, current_name, site, neuron in pairs:
                    rate = _time_mean(seen[s], T)
                    value = rate * channel_view(neuron.theta.detach(), rate.dim())
                    with torch.no_grad():
                        want = site(_time_mean(seen[current_name], T)) if local else ann[a].float()
                    e = (want - value).double()
                    acc = sums[a]
                    acc[0] += e.numel()
                    acc[1] += float(e.sum())
                    acc[2] += float((e * e).sum())
            for a, (n, total, squares) in sums.items():
                # the unbiased variance over the whole batch, as torch.var
                variances[a].append((squares - total * total / n) / max(n - 1, 1))
        return {a: math.sqrt(max(0.0, sum(v) / len(v))) if v else 0.0 for a, v in variances.items()}
    finally:
        qgm.train(was_training)


def _time_mean(v: torch.Tensor, T: int) -> torch.Tensor:
    """The mean over the T steps of a time-folded value ``[T*B, ...]``, ``[B, ...]``."""
    return v.reshape(T, len(v) // T, *v.shape[1:]).float().mean(0)
