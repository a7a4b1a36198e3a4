"""The names that the converter, the file formats and the backends share, defined once.

A leaf: it imports nothing, so every module may import it (the import contracts say so).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["RESETS", "MAX_T", "MAX_BURST", "StageName"]

#: The IF neuron's reset modes: by subtraction of the threshold, or to zero (hard reset).
RESETS = ("subtract", "zero")
#: The largest T (and eval_T, bias_calibration_T) convert() accepts and a NIR file may declare.
#: Direct-encoded conversion reaches the ANN by T = 64-256 on every network measured; a larger T
#: multiplies every stage's time and memory (the calibration holds ``batches x T`` activations).
MAX_T = 1024
#: The most spikes a burst neuron may emit in one step (Loihi 2's graded spikes carry up to 24
#: bits; 8 bits are ample at a few steps, and spike counts are then kept in one byte).
MAX_BURST = 255


class StageName(StrEnum):
    """convert()'s stages, in their order (each is its record's name in ``meta.stages``; a value
    compares equal to its string, as a saved ``meta.json`` holds it)."""

    PREPARE = "prepare"
    FOLD = "fold"
    QCFS = "qcfs"
    SPIKING = "spiking"
    FINETUNE = "finetune"
    EARLY_EXIT = "early_exit"
