"""Fitting a BPTT step into memory: activation checkpointing (a view of the network that
recomputes in backward) and micro-batches (pieces of a batch whose gradients add up to the
batch's), chosen from what one image needs (:func:`plan_step`).

Measured on a 2-core CPU, checkpointing saves little of a converted network's memory: one
step of torchvision's ResNet-50 at 224 px and T=8 kept 1.16 GiB per image, 1.10 checkpointed
per IF layer and 0.71 per block (at 1.2x the time); the ResNet-14 of the fine-tuning benchmark
at batch 128, T=4: +947 MB, +1,042 per IF layer, +910 per block (benchmarks/README.md). Memory
is the activations of the images in one pass, so a batch that does not fit runs in
micro-batches (no recomputation); block checkpointing is kept for a single image that does
not fit otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.errors import ConfigError
from snnconv.memory import TRAINING_FACTOR, images_that_fit, refuse_one_image, saved_bytes, step_budget
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import IFNeuron, neurons

__all__ = ["checkpointed", "StepBudget", "plan_step"]


class _Checkpointed(nn.Module):
    """Run ``module`` under ``torch.utils.checkpoint`` while training (recompute in backward)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)
        return self.module(*args)


def _cut_points(gm: fx.GraphModule) -> set[fx.Node]:
    """IF nodes after which only their own output is live: the boundaries between blocks."""
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    cuts, live_until = set(), -1  # the last position any earlier value is still needed at
    for i, n in enumerate(order):
        if live_until <= i and n.op == "call_module" and isinstance(gm.get_submodule(n.target), IFNeuron):
            cuts.add(n)
        if n.op != "get_attr":
            live_until = max(live_until, max((pos[u] for u in n.users), default=i))
    return cuts


def checkpointed(snn: SpikingNetwork, mode: str) -> SpikingNetwork:
    """A view of ``snn`` with activation checkpointing, sharing its parameters.

    ``"neuron"`` recomputes each IF layer's T-step loop in backward (keeping only its input);
    ``"block"`` splits the graph where a single tensor is live (block outputs) and recomputes
    each segment in backward. Train the view; read and save the weights through ``snn``.
    """
    from torch.fx.passes.split_module import split_module

    gm = snn.net
    if mode == "neuron":
        view = fx.GraphModule(gm, copy.deepcopy(gm.graph), "CheckpointedNeurons")
        for name, m in neurons(gm).items():
            if "." in name:
                raise ConfigError(f"neuron '{name}' is nested; 'neuron' checkpointing needs "
                                 "root-level neurons")
            setattr(view, name, _Checkpointed(m))
        return SpikingNetwork(view, snn.T)
    if mode != "block":
        raise ConfigError(f"activation checkpointing mode must be 'block' or 'neuron', got {mode!r}")
    cuts = _cut_points(gm)
    assign: dict[str, int] = {}
    part = 0
    for n in gm.graph.nodes:
        assign[n.name] = part
        if n in cuts:
            part += 1
    split = split_module(gm, gm, lambda n: assign[n.name])
    for name, child in list(split.named_children()):
        if name.startswith("submod_"):
            setattr(split, name, _Checkpointed(child))
    return SpikingNetwork(split, snn.T)


@dataclass(frozen=True)
class StepBudget:
    """How a training step runs: ``mode`` (None, ``"neuron"`` or ``"block"`` checkpointing),
    ``micro_batch`` images per forward/backward pass, and the estimated bytes one image needs."""

    mode: str | None
    micro_batch: int
    per_image: int

    def to_dict(self) -> dict:
        return {"activation_checkpointing": self.mode, "micro_batch": self.micro_batch,
                "bytes_per_image": self.per_image}


def _checkpoint_inputs(view: SpikingNetwork) -> tuple[list, dict[int, int]]:
    """Forward pre-hooks that collect the storages of what each checkpointed piece is given (the
    tensors it keeps for its recomputation); returns ``(handles, seen)``."""
    seen: dict[int, int] = {}

    def hook(mod, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                s = a.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()

    handles = [m.register_forward_pre_hook(hook) for m in view.modules() if isinstance(m, _Checkpointed)]
    return handles, seen


def step_bytes(snn: SpikingNetwork, x: torch.Tensor, mode: str | None) -> int:
    """Estimated peak bytes of one training step of ``snn`` (at its T) on ``x`` with ``mode``
    checkpointing: :data:`~snnconv.memory.TRAINING_FACTOR` times what autograd keeps (and, where
    checkpointed, what each piece keeps for its recomputation)."""
    view = snn if mode is None else checkpointed(snn, mode)
    was = view.training
    view.train()
    handles, given = _checkpoint_inputs(view) if mode else ([], {})
    try:
        kept = saved_bytes(lambda: view(x), snn)
    finally:
        for h in handles:
            h.remove()
        view.train(was)
    return int(TRAINING_FACTOR * (kept + sum(given.values())))


def plan_step(snn: SpikingNetwork, x: torch.Tensor, batch: int, mode: str | None = "auto",
              micro_batch: int | None = None) -> StepBudget:
    """How a step of ``batch`` images like ``x[:1]`` fits :func:`snnconv.memory.step_budget`.

    ``mode="auto"``: no checkpointing, in micro-batches of as many images as fit; block
    checkpointing one image at a time where a single image does not fit otherwise. A given
    ``mode`` (None, ``"neuron"``, ``"block"``) is kept. ``micro_batch`` fixes the pieces' size.

    Raises:
        ResourceError: a single image does not fit, even checkpointed per block.
    """
    one = x[:1]
    budget = step_budget(x.device)
    with torch.random.fork_rng(devices=[]):
        per = step_bytes(snn, one, None if mode == "auto" else mode)
        if mode == "auto":
            mode = None
            if budget is not None and per > budget and micro_batch is None:
                mode, per = "block", step_bytes(snn, one, "block")
    refuse_one_image(per, x.device, f"a BPTT step at T={snn.T}", "lower T or the input size")
    micro = micro_batch if micro_batch is not None else images_that_fit(per, budget, batch)
    return StepBudget(mode, min(batch, micro), per)
