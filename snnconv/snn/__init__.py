"""The spiking network: the neurons (one IF step, NIR's leaky neurons), :class:`SpikingNetwork`
with its file format (``network``, ``graphfile``), its NIR export and import (``nir_io``) and
the analog prefix's file (``prefixfile``), and the run one step at a time that drops the images
that have exited (``stepping``).
"""
