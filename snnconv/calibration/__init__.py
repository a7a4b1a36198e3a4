"""Training-free calibration of a converted network against the QCFS-ANN it was made from.

- :func:`calibrate_bias` (:mod:`.bias`): bias or initial-membrane shifts per IF layer, with the
  per-neuron arithmetic in :mod:`.membrane` and the weight refit of :mod:`.weights`, all
  calibration images at once where they fit the memory and in groups where not;
- :func:`reconstruct` (:mod:`.reconstruct`): every IF layer's weights fitted by SGD through
  time to the QCFS-ANN's site (the spike-timing error the closed forms leave);
- :func:`calibrate_thresholds` and :func:`shift_bias` (:mod:`.thresholds`): the fixes for
  hard-reset networks;
- :func:`residual_noise` (:mod:`.noise`): the spiking network's error per QCFS site, the noise
  of noise-modelled QCFS training.

All of them work on a copy and record what they did in ``result.meta``.
"""

from snnconv.calibration.bias import calibrate_bias
from snnconv.calibration.noise import residual_noise
from snnconv.calibration.reconstruct import reconstruct
from snnconv.calibration.thresholds import DEFAULT_FACTORS, calibrate_thresholds, shift_bias

__all__ = ["calibrate_bias", "reconstruct", "residual_noise", "calibrate_thresholds", "shift_bias", "DEFAULT_FACTORS"]
