"""Training-free calibration of a converted network against the QCFS-ANN it was made from.

- :func:`calibrate_bias` (:mod:`.bias`): bias or initial-membrane shifts per IF layer, with the
  per-neuron arithmetic in :mod:`.membrane`, the weight refit of :mod:`.weights` and the memory
  check of :mod:`.memory`;
- :func:`calibrate_thresholds` and :func:`shift_bias` (:mod:`.thresholds`): the fixes for
  hard-reset networks.

All of them work on a copy and record what they did in ``result.meta``.
"""

from .bias import calibrate_bias
from .thresholds import DEFAULT_FACTORS, calibrate_thresholds, shift_bias

__all__ = ["calibrate_bias", "calibrate_thresholds", "shift_bias", "DEFAULT_FACTORS"]
