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

This module imports nothing, so that the backends may use it as they use :mod:`snnconv.errors`.
"""

__all__ = ["E_MAC_PJ", "E_AC_PJ", "conv_macs", "linear_macs"]

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
