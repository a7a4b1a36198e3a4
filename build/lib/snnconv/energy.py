"""Energy per arithmetic operation, the one definition every estimate in snnconv uses.

45 nm CMOS, 32-bit float (Horowitz, "Computing's energy problem", ISSCC 2014): a multiply costs
3.7 pJ and an add 0.9 pJ, so a multiply-accumulate (MAC, what an ANN layer does per synapse)
costs 4.6 pJ and an accumulate (AC, what a spike does per synapse) 0.9 pJ. These are the figures
the SNN literature (and spikingjelly's ``SimpleEnergyProfiler``) uses; they count arithmetic
only, no memory traffic or routing.

This module imports nothing, so that the backends may use it as they use :mod:`snnconv.errors`.
"""

__all__ = ["E_MAC_PJ", "E_AC_PJ"]

#: pJ per 32-bit float multiply-accumulate (45 nm).
E_MAC_PJ = 4.6
#: pJ per 32-bit float accumulate (45 nm).
E_AC_PJ = 0.9
