"""snnconv_backends: executors of NIR graphs (cpu, gpu, loihi2-sim, lava), their registry, and the
strict NIR reader they share (``snnconv.nir.reader.parse``).

This package reads ``nir.NIRGraph`` objects and never imports snnconv's conversion stages (an
import-linter contract in pyproject.toml, checked by the tests): it may import ``nir``,
``numpy``, ``torch``, ``spikingjelly``, ``h5py``, ``snnconv.errors`` and ``snnconv.analysis.energy`` only.
"""

from snnconv_backends.registry import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    Backend,
    Program,
    Report,
    RunResult,
    RunWarning,
    available,
    get,
    names,
)

__all__ = ["Backend", "Program", "RunResult", "Report", "RunWarning", "available", "get", "names", "BUILTINS",
           "ENTRY_POINT_GROUP"]
