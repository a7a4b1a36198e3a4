"""The names that the converter, the file formats and the backends share, defined once.

A leaf: it imports nothing, so every module may import it (the import contracts say so).
"""

from __future__ import annotations

__all__ = ["RESETS"]

#: The IF neuron's reset modes: by subtraction of the threshold, or to zero (hard reset).
RESETS = ("subtract", "zero")
