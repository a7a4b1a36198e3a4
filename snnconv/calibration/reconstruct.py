"""Layer-wise reconstruction by SGD: every IF layer's spike rate over T steps, on its input
from the spiking network itself, fitted to the same site of the QCFS-ANN (Li et al.'s
calibration by SGD, 2021), all layers at once.

The closed-form calibrations (:mod:`.bias`, :mod:`.weights`) match means and input rates; what
they leave is the error of spike timing: an IF layer fed spikes that arrive unevenly fires
differently from the QCFS function of their rate, and the error compounds with depth. Here the
weights learn it away by gradient through time (ATan surrogate), from a local loss per layer:
each IF layer's output is detached where the next layers read it, so a layer's loss reaches
only the weights between it and the IF layers before it. The readout is fitted to the
QCFS-ANN's logits. No label is read: the calibration images are enough.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn as nn

from snnconv.activation import QCFS
from snnconv.calibration.reference import calibration_batches, qcfs_levels
from snnconv.errors import ConfigError, StageOrderError
from snnconv.graph import prepare
from snnconv.memory import TRAINING_FACTOR, images_that_fit, refuse_one_image, saved_bytes, step_budget
from snnconv.progress import progress_bar
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import channel_view, neurons

__all__ = ["reconstruct", "RECONSTRUCT_LR", "RECONSTRUCT_BATCH"]

#: Adam's learning rate (cosine-annealed to 0 over the steps) and the images per step.
RECONSTRUCT_LR = 1e-3
RECONSTRUCT_BATCH = 32


def _hooks(snn_net: nn.Module, ref: nn.Module, sources: dict[str, str], got: dict, want: dict) -> list:
    """Forward hooks: each IF layer's spikes into ``got`` (detached where the network reads
    on), each QCFS site of the reference into ``want``."""
    def keep(store: dict, name: str, detach: bool):
        def hook(mod, inp, out):
            store[name] = out
            return out.detach() if detach else None
        return hook

    handles = [m.register_forward_hook(keep(got, n, True)) for n, m in neurons(snn_net).items()]
    handles += [ref.get_submodule(src).register_forward_hook(keep(want, src, False))
                for src in set(sources.values())]
    return handles


def _loss(snn: SpikingNetwork, ref: nn.Module, x: torch.Tensor, sources: dict[str, str],
          part: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Sum over IF layers of the mean squared error of the spike rate against the QCFS site
    (both in units of the layer's threshold), plus the readout's squared error relative to the
    power of the reference's logits. ``part``: ``x`` is a micro-batch of a step of ``part[0]``
    images whose reference logits have the power ``part[1]``; the losses of the micro-batches
    sum to the step's."""
    got: dict = {}
    want: dict = {}
    handles = _hooks(snn.net, ref, sources, got, want)
    try:
        with torch.no_grad():
            target = ref(x)
        logits = snn(x)
    finally:
        for h in handles:
            h.remove()
    T = snn.T
    units = neurons(snn.net)
    share = 1.0 if part is None else len(x) / part[0]
    power = (target ** 2).mean().clamp_min(1e-12) if part is None else part[1]
    loss = ((logits - target) ** 2).mean() / power
    for name, src in sources.items():
        spikes = got[name]
        rate = spikes.reshape(T, spikes.shape[0] // T, *spikes.shape[1:]).mean(0)
        theta = channel_view(units[name].theta.detach(), rate.dim())
        loss = loss + ((rate - want[src] / theta) ** 2).mean()
    return loss if part is None else loss * share


def _step(snn: SpikingNetwork, ref: nn.Module, x: torch.Tensor, sources: dict[str, str], per: int) -> float:
    """The gradient of one step's loss on ``x`` (accumulated into the parameters' ``.grad``), in
    micro-batches of ``per`` images where ``x`` holds more; returns the loss."""
    if len(x) <= per:
        loss = _loss(snn, ref, x, sources)
        loss.backward()
        return float(loss.detach())
    with torch.no_grad():
        power = (ref(x) ** 2).mean().clamp_min(1e-12)
    total = 0.0
    for piece in x.split(per):
        loss = _loss(snn, ref, piece, sources, part=(len(x), power))
        loss.backward()
        total += float(loss.detach())
    return total


def _images_per_piece(snn: SpikingNetwork, x: torch.Tensor, batch: int) -> int:
    """Images of a step that fit one training pass (:func:`snnconv.memory.step_budget`), from
    the bytes autograd keeps on one image."""
    per_image = TRAINING_FACTOR * saved_bytes(lambda: snn(x[:1]), snn)
    refuse_one_image(per_image, x.device, "a reconstruction step",
                     "lower T (the reconstruction runs T steps)")
    return images_that_fit(int(per_image), step_budget(x.device), batch)


def reconstruct(snn: SpikingNetwork, reference: nn.Module, loader: Any, *, steps: int,
                levels: int | None = None, num_batches: int = 10, lr: float = RECONSTRUCT_LR,
                batch_size: int = RECONSTRUCT_BATCH, alpha: float = 4.0, seed: int = 0,
                progress: bool = False) -> tuple[SpikingNetwork, dict]:
    """A copy of ``snn`` whose weights are fitted, layer by layer at once, to ``reference``.

    Args:
        snn: a :class:`SpikingNetwork` made by :func:`snnconv.to_spiking` (its meta maps each
            IF layer to its QCFS site), usually calibrated already.
        reference: the QCFS-ANN it was made from.
        loader: images (batches of ``x`` or ``(x, y)``; labels are ignored); the first
            ``num_batches`` batches are the images each step draws ``batch_size`` from.
        steps: optimiser steps (Adam at ``lr``, cosine-annealed).
        levels: the reference's QCFS levels while it is the target (``None``: as it is).
        alpha: the ATan surrogate's sharpness while fitting (the network's own afterwards).

    A step whose images do not fit the memory (:func:`snnconv.memory.step_budget`, from the
    bytes autograd keeps on one image) runs in micro-batches whose gradients add up to the
    step's, up to float rounding; ``record["micro_batch"]`` says how many images each held.

    Returns:
        ``(network, record)``; ``record`` holds the steps run, the seconds, and the loss on the
        first and last steps.

    Raises:
        StageOrderError: ``snn`` is not a converted network.
        ConfigError: ``steps`` or ``batch_size`` is not a positive count.
        ResourceError: a single image's step does not fit the memory.
    """
    if not isinstance(snn, SpikingNetwork) or "neurons" not in getattr(snn, "meta", {}):
        raise StageOrderError("reconstruct needs a SpikingNetwork made by to_spiking (its meta maps "
                              "each neuron to its QCFS site)")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"reconstruct: {name} must be a positive integer, got {value!r}")
    if levels is not None:
        check_T(levels, "levels (the reference's QCFS levels)")
    device = next(snn.parameters()).device
    ref = prepare(reference, leaf_types=(QCFS,)).to(device).eval().requires_grad_(False)
    # one IF layer per QCFS call site; a QCFS module called at several sites has no single target
    record = snn.meta["neurons"]
    count: dict[str, int] = {}
    for r in record.values():
        count[r["source"]] = count.get(r["source"], 0) + 1
    sites = {str(n.target) for n in ref.graph.nodes
             if n.op == "call_module" and isinstance(ref.get_submodule(str(n.target)), QCFS)}
    sources = {n: r["source"] for n, r in record.items() if count[r["source"]] == 1 and r["source"] in sites}
    images = torch.cat([x.to(device) for x in calibration_batches(loader, num_batches,
                                                                 "reconstruction loader")])
    out = copy.deepcopy(snn)
    units = list(neurons(out.net).values())
    old_alpha = [m.alpha for m in units]
    for m in units:
        m.set_surrogate(alpha=alpha)
    params = [p for p in out.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    draw = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    out.train()
    batch = min(batch_size, len(images))
    per = _images_per_piece(out, images, batch)
    bar = progress_bar(total=steps, desc="reconstruction", disable=not progress, leave=False)
    try:
        with qcfs_levels(ref, levels):
            for _ in range(steps):
                idx = torch.randint(len(images), (batch,), generator=draw)
                opt.zero_grad(set_to_none=True)
                losses.append(_step(out, ref, images[idx.to(images.device)], sources, per))
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
    finally:
        bar.close()
        out.eval()
        for m, a in zip(units, old_alpha):
            m.set_surrogate(alpha=a)
    summary = {"steps": steps, "seconds": time.perf_counter() - t0, "images": len(images), "micro_batch": per,
               "layers": len(sources), "levels": levels, "loss_first": losses[0], "loss_last": losses[-1]}
    out.meta["reconstruction"] = summary
    return out, summary
