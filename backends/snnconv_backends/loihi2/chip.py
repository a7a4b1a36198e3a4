"""Loihi 2 as the simulator models it: the bit budget of a neuro core, the clock neuron, and the
published per-operation figures (energy, capacity, step time) the cost model uses."""

from __future__ import annotations

from typing import Mapping

from snnconv.analysis.energy import E_MAC_PJ

__all__ = ["LOIHI", "FIRST_VTH", "CLOCK", "E_SYNOP", "E_NEURON_UPDATE", "E_SPIKE", "E_MAC_FP32",
           "CORES_PER_CHIP", "NEURONS_PER_CORE", "SYNAPSES_PER_CORE", "STEP_SECONDS"]

# --- the bit budget (Lava 0.10.0 fixed-point models) ----------------------------------------

#: Bit widths and shifts of Loihi's neuro core as modelled by Lava's bit-accurate models.
LOIHI: Mapping[str, int] = {
    "uv_bits": 24,          # u, v: 24-bit signed (PyLifModelBitAcc: precision=24)
    "act_shift": 6,         # a_in << 6 into u (AbstractPyLifModelFixed.act_shift)
    "vth_shift": 6,         # spike on v > vth << 6 (vth_shift)
    "vth_max": 2**17 - 1,   # vth: unsigned 17-bit
    "bias_mant_max": 4095,  # bias_mant: signed 13-bit (we use -4095..4095)
    "bias_exp_max": 7,      # bias_exp: unsigned 3-bit
    "weight_max": 255,      # 8-bit weight mantissa; mixed sign: even values -256..254
    "weight_exp_min": -8,   # Loihi weight exponent range (Lava accepts any; Loihi: -8..7)
    "weight_exp_max": 7,
    "a_in_max": 2**15 - 1,  # a_in / Dense a_out: declared 16-bit signed in Lava
}
FIRST_VTH = 2**12  # first layer: vth << 6 = 2**18, bias reach ~2 * threshold

#: Name of the always-on neuron that delivers biases.
CLOCK = "__clock__"

# --- published per-operation figures (energy, latency) --------------------------------------

#: Davies et al., "Loihi: A Neuromorphic Manycore Processor with On-Chip Learning", IEEE Micro
#: 38(1), 2018, Table 2 (Loihi 1, 14 nm). Intel has not published per-operation energies for
#: Loihi 2 (Intel 4); we use these Loihi 1 figures as an upper estimate.
E_SYNOP = 23.6e-12          # J per synaptic spike operation
E_NEURON_UPDATE = 52e-12    # J per active neuron update
E_SPIKE = 1.7e-12           # J per spike sent within a tile
#: J per fp32 multiply-accumulate of the ANN: :data:`snnconv.analysis.energy.E_MAC_PJ` (Horowitz, ISSCC
#: 2014, 45 nm), the per-MAC figure the SNN literature uses for the ANN on GPU-class hardware
#: (an optimistic one: it leaves out memory traffic).
E_MAC_FP32 = E_MAC_PJ * 1e-12
#: Loihi 2 brief (Intel, "Taking Neuromorphic Computing to the Next Level with Loihi 2",
#: 2021): 128 neuro cores per chip, up to 1M neurons and 120M synapses per chip, i.e. 8192
#: neurons per core; the per-core synapse figure below is the chip total / 128 (approximate:
#: the real capacity depends on weight precision, sparsity, weight sharing and axon tables).
CORES_PER_CHIP = 128
NEURONS_PER_CORE = 8192
SYNAPSES_PER_CORE = 120_000_000 // 128
#: Seconds per algorithmic time step: an assumption, not a published constant. Loihi's step
#: time depends on activity and on the barrier synchronisation across cores; reported values
#: for small networks are in the microseconds to tens of microseconds (order of magnitude).
STEP_SECONDS = 10e-6
