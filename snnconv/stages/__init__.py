"""The stages :func:`snnconv.convert` runs, one module each and named as in ``meta.stages``.

``prepare`` (trace, rewrite the constructs), ``fold`` (BatchNorm), ``qcfs`` (thresholds; the
activation every ReLU becomes is :mod:`snnconv.activation`), ``spiking`` (IF neurons, calibration in
:mod:`snnconv.calibration`) and ``finetune`` (BPTT). The order lives in :mod:`snnconv.pipeline`.
"""
