"""Backends that run exported NIR graphs: ``snnconv.backends.get("cpu").compile(graph).run(x, T)``.

A thin re-export of :mod:`snnconv_backends` (which never imports the conversion stages).
"""

from snnconv_backends import Backend, Program, Report, RunResult, RunWarning, available, get, names

__all__ = ["available", "get", "names", "Backend", "Program", "RunResult", "Report", "RunWarning"]
