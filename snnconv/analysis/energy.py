"""Energy per arithmetic operation and the ANN's operation count: the one definition every
estimate in snnconv (analysis, ``evaluate``, the report, the backends, ``snnconv run``) uses.

45 nm CMOS, 32-bit float (Horowitz, "Computing's energy problem", ISSCC 2014): a multiply costs
3.7 pJ and an add 0.9 pJ, so a multiply-accumulate (MAC, what an ANN layer does per synapse)
costs 4.6 pJ and an accumulate (AC, what a spike does per synapse) 0.9 pJ. These are the figures
the SNN literature (and spikingjelly's ``SimpleEnergyProfiler``) uses; they count arithmetic
only, no memory traffic or routing.

The ANN's MACs of a layer are its synapses for one image: a convolution's kernel taps that land
on the input, not on its zero padding (:func:`conv_macs`), a linear layer's weights. A spike is
counted the same way (one AC per outgoing synapse), so a layer whose inputs all spike at every
step does exactly ``T`` ACs per MAC. Energies are compared as **SNN / ANN** (below 1: the SNN
spends less).

One comparison per target, each named where it is printed:

- **arithmetic** (:func:`arithmetic_energy`, every path: ``analyse`` / ``snnconv evaluate``,
  ``snnconv run`` on any backend, the report): synaptic operations at 45 nm against the ANN's
  MACs at 45 nm. The SNN side is one AC per spike and outgoing synapse (a spike's synapses are
  those of the weighted layer it reaches through pooling, flattening and adds, as the backends
  count them), plus MACs where a layer sees analog values: once per image for the layers that
  see only the static input (the analog prefix included), at every step for a layer fed by
  another analog value. Counted on the spiking graph that runs, so ``evaluate`` and ``run
  --backend cpu`` give the same figure for the same images.
- **a published chip's figures** (``loihi2-sim`` and ``lava`` only, their own report): energy
  per synaptic operation, neuron update and spike measured on Loihi 1 (no per-operation figures
  are published for Loihi 2) against the same 45 nm MAC. It differs from the arithmetic figure
  because it charges every neuron update at every step and a chip's synaptic operation costs
  more than a 45 nm add: the two answer different questions and are never printed as one.

This module imports nothing, so that the backends may use it as they use :mod:`snnconv.errors`.
"""

import math

__all__ = ["E_MAC_PJ", "E_AC_PJ", "conv_macs", "linear_macs", "ARITHMETIC", "ARITHMETIC_NOTE",
           "CHIP_NOTE", "arithmetic_energy", "format_arithmetic"]

#: The arithmetic comparison's name, as every path prints it.
ARITHMETIC = "synaptic operations at 45 nm"
#: Its assumptions, in one line.
ARITHMETIC_NOTE = ("0.9 pJ per AC (one per spike and synapse), 4.6 pJ per MAC (the ANN's every "
                   "synapse; the SNN's layers that see analog values), 32-bit float, 45 nm CMOS "
                   "(Horowitz, ISSCC 2014); arithmetic only: no neuron updates, memory or routing")
#: Why a chip backend's figure differs from the arithmetic one (the report prints it).
CHIP_NOTE = ("a published chip's figures (Loihi 1, Davies et al. 2018: per synaptic operation, "
             "neuron update and spike; every neuron updated at every step) against the same 45 nm "
             "MAC: not the arithmetic comparison, and larger where neuron updates dominate")

#: pJ per 32-bit float multiply-accumulate (45 nm).
E_MAC_PJ = 4.6
#: pJ per 32-bit float accumulate (45 nm).
E_AC_PJ = 0.9


def conv_macs(in_shape, weight_shape, stride, padding, dilation) -> int:
    """Multiply-accumulates of a convolution on one image: taps that land on the input.

    Args:
        in_shape: batch-free input shape ``(C_in, *spatial)``.
        weight_shape: ``(C_out, C_in / groups, *kernel)``.
        stride, dilation: one integer per spatial dimension.
        padding: zero padding per spatial dimension, an integer (both sides) or a
            ``(before, after)`` pair.

    Returns:
        ``C_out * C_in / groups * prod_d(valid taps of dimension d)``: for each spatial
        dimension, the (output position, kernel tap) pairs whose input index lies inside
        ``[0, n)``. Without padding this is the dense count ``out_elements * prod(weight_shape[1:])``.
    """
    taps = 1
    for n, k, s, p, d in zip(in_shape[1:], weight_shape[2:], stride, padding, dilation):
        before, after = (p, p) if isinstance(p, int) else p
        out = (n + before + after - d * (k - 1) - 1) // s + 1
        taps *= sum(1 for o in range(out) for j in range(k) if 0 <= o * s - before + j * d < n)
    return int(weight_shape[0]) * int(weight_shape[1]) * taps


def linear_macs(weight_shape) -> int:
    """Multiply-accumulates of a linear layer on one image: its weights, ``out * in``."""
    return int(weight_shape[0]) * int(weight_shape[1])


def arithmetic_energy(*, synops: float, analog_macs: float, ann_macs: float, images: int) -> dict:
    """The arithmetic comparison (pJ per image): the one definition every path uses.

    Args:
        synops: accumulates of the spike-driven layers over the run (all images, all steps).
        analog_macs: MACs of the SNN's layers that see analog values over the run (a static
            layer once per image, a layer fed by another analog value at every step).
        ann_macs: the ANN's MACs for the same images.
        images: how many images the counts are over.

    Returns:
        ``snn_pj``, ``ann_pj``, ``ratio`` (SNN / ANN), ``e_ac_pj``, ``e_mac_pj``, ``model``
        (:data:`ARITHMETIC`) and ``note`` (:data:`ARITHMETIC_NOTE`).
    """
    images = max(int(images), 1)
    snn = (float(synops) * E_AC_PJ + float(analog_macs) * E_MAC_PJ) / images
    ann = float(ann_macs) * E_MAC_PJ / images
    return {"snn_pj": snn, "ann_pj": ann, "ratio": snn / ann if ann else math.nan,
            "e_ac_pj": E_AC_PJ, "e_mac_pj": E_MAC_PJ, "model": ARITHMETIC, "note": ARITHMETIC_NOTE}


def format_arithmetic(e: dict) -> str:
    """The one printed line of :func:`arithmetic_energy`'s record (evaluate, run, the report)."""
    return (f"energy per image, {ARITHMETIC}: SNN {e['snn_pj'] / 1e3:.1f} nJ, ANN "
            f"{e['ann_pj'] / 1e3:.1f} nJ, SNN/ANN {e['ratio']:.3f} ({ARITHMETIC_NOTE})")
