"""The spiking network's residual error at each QCFS site, the noise of noise-modelled QCFS
training (Hu et al., arXiv 2404.17456): per site, the standard deviation of the QCFS-ANN's
output minus the converted network's ``theta * spike rate`` over T steps, each network run on
the same images from the input."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.fx as fx

from snnconv.graph import capture, module_of
from snnconv.snn.neuron import IFNeuron, channel_view
from snnconv.stages.qcfs import QCFS
from snnconv.stages.spiking import to_spiking

__all__ = ["residual_noise"]


def residual_noise(qgm: fx.GraphModule, batches: list[torch.Tensor], *, T: int,
                   reset: str = "subtract", local: bool = True) -> dict[str, float]:
    """Per QCFS call site of ``qgm`` (its fx node name): the residual error's standard deviation.

    ``qgm`` is converted (a copy: :func:`snnconv.stages.spiking.to_spiking` at ``T`` steps and
    ``reset``) and run on each batch of ``batches``. Per batch, the variance over every output
    element of the site's error; the result is the square root of its mean over the batches.

    ``local=True`` (default): the error the layer itself adds, ``QCFS(mean_t I_t) - theta *
    rate``, with ``I_t`` the current the IF neuron receives from the spiking layers before it:
    what the site's QCFS makes of the mean of that input, against what the neuron fires on
    it. Injected at every site during training, the errors of earlier layers reach a later
    one through the forward pass itself. ``local=False``: the reference's model (Hu et al.),
    ``QCFS(z_ann) - theta * rate(z_snn)`` with each network run from the input, which counts an
    earlier layer's error again at every later site; as the noise of QCFS training on the
    matrix's ResNet-20 and MobileNet (Fashion-MNIST, L=T=4, three epochs) it took the training
    accuracy to 11-23% (benchmarks/README.md, "Noise-modelled QCFS training").
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
        for x in batches:
            ann = {} if local else capture(qgm, (x,), [p[0] for p in pairs])
            seen = capture(snn.net, (x,), [p[1] for p in pairs] + ([p[2] for p in pairs] if local else []))
            for a, s, current_name, site, neuron in pairs:
                train = seen[s]
                rate = train.reshape(T, len(x), *train.shape[1:]).float().mean(0)
                value = rate * channel_view(neuron.theta.detach(), rate.dim())
                if local:
                    current = seen[current_name]
                    with torch.no_grad():
                        want = site(current.reshape(T, len(x), *current.shape[1:]).float().mean(0))
                else:
                    want = ann[a].float()
                variances[a].append(float((want - value).var()))
        return {a: math.sqrt(sum(v) / len(v)) if v else 0.0 for a, v in variances.items()}
    finally:
        qgm.train(was_training)
