"""The Lava side of the ``lava`` backend: ``worker.py`` runs under the Python 3.10 side environment.

Nothing here is imported by snnconv itself (this package imports only numpy, scipy, lava and the
standard library, and only when run by ``.venv-lava/bin/python``).
"""
