"""The Lava side of the ``lava`` backend: ``worker.py`` runs under the Python 3.10 side environment.

Nothing here but ``procgroup`` (standard library only, shared by both sides) is imported by snnconv
itself; ``worker.py`` imports only numpy, scipy, lava and the standard library, and runs under
``.venv-lava/bin/python``.
"""
