"""The dense executor the cpu and gpu backends share: a parsed NIR graph run as torch ops.

Arithmetic is the torch ``SpikingNetwork``'s, operation for operation, so that results are
bit-identical on the same device and dtype:

- layers that see only the static input (before the first neuron) run once on ``[b, ...]``;
  everything after a neuron runs with time folded into the batch, ``[T*b, ...]`` (t major);
- the batch is cut into chunks of ``max(1, chunk_size // T)`` inputs, as
  ``SpikingNetwork._steps`` does (oneDNN and MKL may round a batch of one differently from a
  larger one, so the batch composition of every conv and matmul must be the same);
- the subtractive neuron divides its input by theta (one division, broadcast on the channel
  dim), then runs ``h = v + u; s = h >= 1; v = h - s`` from ``v = 1/2``, in place (the
  spikingjelly kernel the torch network uses computes the same three operations, with copies);
- the hard-reset neuron runs ``h = v + x; s = h >= theta; v = h - h * s`` from ``v = 0``
  (equal values to spikingjelly's ``s * 0 + (1 - s) * h``; they differ at most in the sign of
  a zero membrane, which no comparison sees);
- a global ``AvgPool2d`` marked ``adaptive`` runs as ``adaptive_avg_pool2d`` (torch rounds the two
  differently), summed inputs are added in edge order.

Statistics (spike counts per step, synaptic operations, ANN MACs) come from one reduction of
each neuron's spikes over the batch. Synaptic operations of a layer fed by spikes (directly or
through pooling/flatten) are each spike times its structural fan-out through that composition
(every weight position counts, padding excluded, pooling folded into the layer), computed once
per graph; for a layer fed directly by spikes this is spikingjelly's ``SynOpCounter`` count.
"""

from snnconv_backends.engine.bound import BoundGraph, check_options, check_T
from snnconv_backends.engine.kernels import compiled_loop
from snnconv_backends.engine.ops import WEIGHTED
from snnconv_backends.engine.program import BoundProgram, StepStats, dtype_option
from snnconv_backends.engine.stats import Stats

__all__ = ["BoundGraph", "BoundProgram", "Stats", "StepStats", "check_options", "check_T", "compiled_loop",
           "dtype_option", "WEIGHTED"]
