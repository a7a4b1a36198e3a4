"""``loihi2-sim``: a vectorised, bit-exact fixed-point model of a converted SNN on Loihi 2.

The arithmetic is that of Intel's bit-accurate Lava process models (lava-nc 0.10.0,
``lava/proc/dense/models.py`` ``PyDenseModelBitAcc`` and ``lava/proc/lif/models.py``
``PyLifModelBitAcc``), batched with torch integer tensors. The ``lava`` backend runs the same
:class:`QuantizedNetwork` in Lava itself, and the tests check both agree bit for bit.

Per step, for every neuron (``a_in`` the sum of the incoming connections' outputs)::

    connection k:  a_k = (sum_j m_kj * s_j) << e_k      (>> -e_k, a floor, when e_k < 0)
                   m_kj: 8-bit weight mantissas (even values in mixed-sign mode), one
                   exponent e_k per connection, one step of synaptic delay (+ extra delays)
    u = wrap24(a_in << 6)                 (du = 4095: the current does not persist)
    v = clip24(v + u + bias)              (dv = 0: integrate; bias = mant << exp, 13-bit mant)
    s = v > vth << 6
    hard reset ("zero"):       v = 0 where s          (Lava's LIF, du=4095, dv=0)
    subtractive ("subtract"):  v = v - (vth << 6) where s, v[0] = (vth << 6) / 2, or
                               round(v_init * (vth << 6)) per neuron after membrane
                               calibration (a custom neuron program, as Loihi 2's
                               programmable neurons allow; Lava has no such built-in neuron)

NIR's leaky neurons run as Lava's own CUBA LIF with decays from ``dt / tau`` (``LIF``, ``CubaLIF``;
an ``LI`` directly before the Output is a leaky readout)::

    u = wrap24(trunc(u * (4096 - (du + 1)) / 4096) + (a_in << 6))
    v = clip24(trunc(v * (4096 - dv) / 4096) + u + bias);  s = v > vth << 6;  v = 0 where s

with ``dv = round(4096 dt / tau_mem)``, ``du = round(4096 dt / tau_syn) - 1`` (4095 for LIF)
and the input gain ``dt/tau * r`` (CubaLIF: times ``dt/tau_syn * w_in``) folded into the weights;
what Lava's neuron lacks (a leak potential, a reset other than 0, several time constants in
one layer) is refused (:mod:`.leaky`).

Mapping of a parsed NIR graph (:func:`quantize`):

- every neuron op is a population; every op chain from a neuron's spikes to another neuron
  (or the readout) is one connection: a single convolution stays a convolution on integer
  tensors, an identity shortcut (``Scale``) a one-to-one connection, any other chain (pooling,
  flatten, linear) is composed into an integer weight matrix; the biases of IF neurons and of
  the readout are the neurons' bias current (13-bit mantissa, exponent 0..7 per neuron, as the
  first layer's input), which starts when the layer's first input arrives (``loihi2-sim``
  adds it over the population's own ``T`` steps; Lava pauses after ``depth`` steps and writes
  it); a population's threshold is lowered until its biases fit (``4095 << 7``). On the 8-bit
  connection from an always-on "clock" neuron they used before, up to all of a layer's biases
  rounded to zero (their exponent is set by the largest one); leaky neurons keep that
  connection (a CubaLIF's bias is a synaptic current, which decays);
- the static first layer (direct encoding) runs off-chip in float32 (as the input encoder)
  and enters the first neurons as per-neuron bias currents (13-bit mantissa, exponent 0..7);
- each population sits at a pipeline depth (the longest chain of connections from the
  first layer); a connection spanning ``k`` depths gets ``k - 1`` steps of extra synaptic
  delay, so every neuron sees its inputs aligned exactly as in the time-stepped network. The
  chip runs ``T + depth`` steps; the readout's last ``T`` steps are the network's output;
- the readout neurons do not spike: their membrane is the per-step value of the last layer
  (``v = clip24(a_in << 6)``), read every step.

A static value that reaches a later population beside spikes (the analog prefix's output on a
residual shortcut) is computed off-chip once per image, as the first layer's input, and enters
that population as a per-neuron bias current (13-bit mantissa, exponent 0..7) from its own
first step: ``loihi2-sim`` adds it over the population's ``T`` steps, Lava pauses after ``depth``
steps and writes it (its input arrives at step ``depth + 1``). Such a population's ``vth`` is at
most ``2**11``, so the bias reaches four thresholds (clipping beyond is counted).

One threshold per channel: where the single threshold below would fall under ``2**10``, each
channel gets the largest ``vth`` its own worst case allows,
as a custom neuron program (Lava: ``ChannelIF``). An IF neuron's spikes do not change when its
weights, bias, threshold and initial membrane are scaled together, so this is exact in the
float network; a channel that cannot fit even at vth = 1 has its threshold raised (counted).

Quantisation (per population): one integer threshold ``vth`` (17 bits; per-channel
thresholds are folded into the incoming weights). Its ceiling is the largest value for which
the worst case of ``a_in`` (every input spiking) fits in 16 signed bits (Lava's ``a_in`` port
precision), so the 24-bit current can never wrap. Within the octave below that ceiling,
``vth`` is placed where the incoming weights round most finely relative to it: every weight
scales with ``vth`` while each connection's exponent moves in powers of two, so just below an
exponent step a connection's largest mantissa fills all 8 bits (:func:`_best_vth`). Then each connection's exponent
follows from its largest weight. A connection whose weights have both signs is mapped as two
synapse groups, one excitatory and one inhibitory, sharing its exponent (``split_signs``, on
by default): each keeps 8 bits of magnitude, where Lava's mixed sign mode keeps 7 (even
mantissas). Zero mantissas are absent synapses, so the split costs no synapses; in Lava it is
two Dense/Sparse processes into the same neurons.

Finer weights on 8-bit synapses (``weight_groups``): a connection's rounding residual becomes a
second synapse group ``"<name>.lo"`` from the same source with an exponent about 8 lower
(negative exponents floor each group's sum, as Lava's Dense does), so the pair carries ~15-bit
weights at twice that connection's synapses and synaptic operations. By default (``"auto"``) a
connection gets it where its 8-bit weights' relative RMS rounding error exceeds 0.5% (one
exponent per connection leaves the rows of a wide layer whose weights are small against its
largest a few bits; the measurements: benchmarks/README.md, "Defaults", row "Loihi 2 second
synapse group"). ``1`` or ``2`` (or a mapping ``{connection: groups}``)
force one choice.

IF neurons' biases beyond what can change a spike (above the threshold plus the most negative
input sum: the neuron fires at every step; below minus the largest input sum: it never fires)
are clipped to those bounds before the layer's scale is chosen, so that a channel calibration
left saturated or silent does not reduce every other neuron's threshold to a few bits.

``mse_exponents=True`` also tries the two exponents below the one that fits a connection's
largest weight (clipping outliers) and keeps the least squared error; off by default.

Decision agreement with cpu is bounded by the float network's own stability: a converted
network whose decisions flip when its input is perturbed by a relative 1e-4 (below the first
layer's 13-bit rounding) cannot agree better with any finite-precision copy of itself
(``python -m benchmarks backends loihi2_agreement`` measures both per network).

Nothing is wrapped silently: the worst case is checked on the integer
mantissas at compile time, and saturation, wrapping and bias clipping are counted at run time.
"""

# the ``X as X`` imports: public names importable from here, outside __all__
from snnconv_backends.loihi2.backend import Loihi2Program, Loihi2SimBackend
from snnconv_backends.loihi2.backend import check_input as check_input
from snnconv_backends.loihi2.chip import CLOCK, LOIHI
from snnconv_backends.loihi2.chip import CORES_PER_CHIP as CORES_PER_CHIP
from snnconv_backends.loihi2.chip import E_MAC_FP32 as E_MAC_FP32
from snnconv_backends.loihi2.chip import E_NEURON_UPDATE as E_NEURON_UPDATE
from snnconv_backends.loihi2.chip import E_SPIKE as E_SPIKE
from snnconv_backends.loihi2.chip import E_SYNOP as E_SYNOP
from snnconv_backends.loihi2.chip import FIRST_VTH as FIRST_VTH
from snnconv_backends.loihi2.chip import NEURONS_PER_CORE as NEURONS_PER_CORE
from snnconv_backends.loihi2.chip import STEP_SECONDS as STEP_SECONDS
from snnconv_backends.loihi2.chip import SYNAPSES_PER_CORE as SYNAPSES_PER_CORE
from snnconv_backends.loihi2.cost import energy, resources
from snnconv_backends.loihi2.fidelity import FLUSH_TOLERANCE as FLUSH_TOLERANCE
from snnconv_backends.loihi2.fidelity import RATE_TOLERANCE as RATE_TOLERANCE
from snnconv_backends.loihi2.fidelity import QuantisationWarning as QuantisationWarning
from snnconv_backends.loihi2.network import Connection, Population, QuantizedNetwork
from snnconv_backends.loihi2.quantisation import quantize
from snnconv_backends.loihi2.report import build_result as build_result
from snnconv_backends.loihi2.report import format_report
from snnconv_backends.loihi2.report import quantisation_report as quantisation_report
from snnconv_backends.loihi2.simulate import bias_current, run_quantized

__all__ = ["Loihi2SimBackend", "Loihi2Program", "QuantizedNetwork", "Population", "Connection",
           "quantize", "run_quantized", "bias_current", "resources", "energy", "format_report",
           "LOIHI", "CLOCK"]
