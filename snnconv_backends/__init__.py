"""Executors for snnconv's NIR graphs, and the strict NIR reader they share.

``snnconv_backends.nirgraph.parse(graph)`` turns a ``nir.NIRGraph`` into a flat, topologically
ordered list of operations with exact spiking semantics (see :mod:`snnconv_backends.nirgraph`).
This package imports ``nir``, ``numpy``, ``torch``, ``spikingjelly``, ``h5py`` and
``snnconv.errors`` only, never another snnconv module.
"""

__all__: list[str] = []
