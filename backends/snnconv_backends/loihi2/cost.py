"""Cost model: neurons, synapses and cores under Loihi 2's per-core limits, energy per image
against the ANN's multiply-accumulates."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from snnconv.nir.reader import ParsedGraph
from snnconv_backends.engine.stats import macs_per_image
from snnconv_backends.loihi2.chip import (
    CLOCK,
    CORES_PER_CHIP,
    E_MAC_FP32,
    E_NEURON_UPDATE,
    E_SPIKE,
    E_SYNOP,
    NEURONS_PER_CORE,
    SYNAPSES_PER_CORE,
)
from snnconv_backends.loihi2.network import Connection, QuantizedNetwork

__all__ = ["resources", "energy", "ann_macs", "with_analog_prefix", "CHIP_MODEL"]

#: The chip comparison's name, as every path prints it (the arithmetic one: snnconv.analysis.energy).
CHIP_MODEL = "a published chip's figures (Loihi 1, Davies et al. 2018) against a 45 nm MAC"


def _synapses(c: Connection) -> int:
    return int(round(float(np.sum(c.fanout))))


def resources(q: QuantizedNetwork) -> dict[str, Any]:
    """Neurons, synapses, fan-in/fan-out and cores per population under Loihi 2's per-core limits.

    Cores per population: ``max(ceil(neurons / 8192), ceil(incoming synapses / SYNAPSES_PER_CORE))``
    (see the constants' sources; synapses counted unshared, an upper bound for convolutions).
    """
    shapes = {p.name: p.shape for p in q.populations}
    shapes[CLOCK] = (1,)
    fan_out: dict[str, int] = {}
    layers = {}
    total_cores = 1  # the clock neuron shares a core in practice; counted once
    for p in q.populations:
        syn = 0
        for c in p.conns:
            k = _synapses(c)
            syn += k
            fan_out[c.source] = fan_out.get(c.source, 0) + k
        cores = max(math.ceil(p.size / NEURONS_PER_CORE), math.ceil(syn / SYNAPSES_PER_CORE), 1)
        total_cores += cores
        layers[p.name] = {"neurons": p.size, "synapses_in": syn,
                          "fan_in_mean": syn / max(p.size, 1), "depth": p.depth, "cores": cores}
    for name, k in fan_out.items():
        if name in layers:
            layers[name]["fan_out_mean"] = k / max(layers[name]["neurons"], 1)
    neurons = sum(p.size for p in q.populations) + 1
    synapses = sum(v["synapses_in"] for v in layers.values())
    return {"layers": layers, "neurons": neurons, "synapses": synapses, "cores": total_cores,
            "chips": math.ceil(total_cores / CORES_PER_CHIP),
            "limits": {"cores_per_chip": CORES_PER_CHIP, "neurons_per_core": NEURONS_PER_CORE,
                       "synapses_per_core": SYNAPSES_PER_CORE},
            "source": "Loihi 2 brief (Intel 2021): 128 cores/chip, 1M neurons and 120M synapses per "
                      "chip; per-core synapses = chip total / 128 (approximate)"}


def energy(q: QuantizedNetwork, T: int, B: int, synops: Mapping[str, float],
           spike_total: float, macs: Mapping[str, float], mean_steps: float | None = None) -> dict[str, Any]:
    """Energy per image from synaptic ops, neuron updates and spikes, against the ANN's MACs;
    ``snn_over_ann`` is their ratio, SNN / ANN (:mod:`snnconv.analysis.energy`'s convention).
    ``mean_steps``: the mean of the steps each image ran (early exit; default T), the steps its
    neurons are updated besides the pipeline's depth."""
    run = float(T if mean_steps is None else mean_steps)
    steps = run + q.depth
    neurons = sum(p.size for p in q.populations) + 1
    syn = float(sum(synops.values())) / B
    updates = float(neurons * steps)
    spikes = float(spike_total) / B
    e_snn = syn * E_SYNOP + updates * E_NEURON_UPDATE + spikes * E_SPIKE
    ann = float(sum(macs.values())) / B
    e_ann = ann * E_MAC_FP32
    return {"per_image_J": e_snn, "synops_per_image": syn, "neuron_updates_per_image": updates,
            "spikes_per_image": spikes, "ann_macs_per_image": ann, "ann_per_image_J": e_ann,
            "snn_over_ann": e_snn / e_ann if e_ann > 0 else float("inf"),
            "figures_pJ": {"synop": E_SYNOP * 1e12, "neuron_update": E_NEURON_UPDATE * 1e12,
                           "spike": E_SPIKE * 1e12, "ann_mac": E_MAC_FP32 * 1e12},
            "model": CHIP_MODEL,
            "sources": "SNN: Davies et al. 2018, IEEE Micro 38(1), Table 2 (Loihi 1; no per-op "
                       "figures are published for Loihi 2). ANN: Horowitz, ISSCC 2014, fp32 MAC "
                       "(45 nm), as used across the SNN literature.",
            "steps_per_image": run,
            "note": ("every neuron is updated at every one of the T + depth steps" if mean_steps is None else
                     "each image's neurons are updated at each of its steps up to its exit, plus the depth")}


def ann_macs(g: ParsedGraph, B: int) -> dict[str, float]:
    """Multiply-accumulates of the ANN per weighted op, for a batch of ``B`` images (the count of
    :func:`snnconv_backends.engine.stats.macs_per_image`, as every backend reports it)."""
    return {k: v * B for k, v in macs_per_image(list(g.ops)).items()}


def with_analog_prefix(e: Mapping[str, Any], macs_per_image: float) -> dict[str, Any]:
    """The energy record ``e`` of the graph run on the chip, with an analog prefix of
    ``macs_per_image`` MACs (run off the chip, once per image) on both sides: the ANN then counts
    the whole network, as the arithmetic model's rows do, and the SNN its prefix too."""
    out = dict(e)
    m = float(macs_per_image)
    mac_j = E_MAC_FP32 * m
    out.update(ann_macs_per_image=e["ann_macs_per_image"] + m, ann_per_image_J=e["ann_per_image_J"] + mac_j,
               per_image_J=e["per_image_J"] + mac_j, analog_prefix_macs_per_image=m)
    out["snn_over_ann"] = out["per_image_J"] / out["ann_per_image_J"] if out["ann_per_image_J"] > 0 else float("inf")
    return out
