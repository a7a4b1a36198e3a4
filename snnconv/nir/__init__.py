"""NIR, the one package the converter and the backends share: snnconv's encoding (``format``),
the strict reader every executor uses (``reader``, with ``leaky`` and ``values``) and the file
layer (``file``: atomic writes with a digest, strict reads of untrusted files).

It imports nothing of the conversion stages; a SpikingNetwork's export and import, which need
the network, are :mod:`snnconv.snn.nir_io`.
"""
