"""The entry points' shared front.

``python -m benchmarks ENTRY QUESTION [ARGS]`` runs one question's module with its own flags
(the same as ``python -m benchmarks.ENTRY.QUESTION [ARGS]``); ``python -m benchmarks ENTRY
--tiny [--out DIR]`` runs the entry's tiny mode: seconds on made or tiny real data, its tables
and JSON written into DIR (a temporary folder when not given).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field

__all__ = ["Entry", "run"]


@dataclass(frozen=True)
class Entry:
    """One entry point: its questions (module name -> what it measures) and its tiny run.

    Args:
        name: the entry's package under ``benchmarks`` (``matrix``).
        summary: one line on what the entry answers.
        questions: module name under the entry's package -> one line on what it measures.
        tiny: the tiny run, as a question and its arguments; ``{out}`` in an argument is the
            tiny run's folder.
        example: a command line shown by ``--help``.

    Raises:
        ValueError: where the tiny run's question is not one of ``questions``.
    """

    name: str
    summary: str
    questions: dict[str, str] = field(default_factory=dict)
    tiny: tuple[str, ...] = ()
    example: str = ""

    def __post_init__(self) -> None:
        if not self.tiny or self.tiny[0] not in self.questions:
            raise ValueError(f"entry {self.name!r}: tiny run {self.tiny!r} does not start with one of "
                             f"its questions {sorted(self.questions)}")
        for question in self.questions:
            if not question.isidentifier():
                raise ValueError(f"question {question!r} of {self.name!r} is not a module name")

    def main(self, argv: list[str] | None = None) -> int:
        """``python -m benchmarks NAME [ARGS]``: see :func:`run`."""
        return run(self, argv)


def run(entry: Entry, argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` to a question's ``main(argv)``, or run the tiny mode; the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in entry.questions:
        module = importlib.import_module(f"benchmarks.{entry.name}.{argv[0]}")
        return int(module.main(argv[1:]) or 0)
    width = max(map(len, entry.questions), default=0)
    listing = "\n".join(f"  {q:<{width}}  {what}" for q, what in entry.questions.items())
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {entry.name}", description=entry.summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"questions (each takes its own --help):\n{listing}\n\nexample:\n  {entry.example}")
    parser.add_argument("--tiny", action="store_true", help="a run of seconds that writes the tables into --out")
    parser.add_argument("--out", help="folder for the tiny run's results (default: a temporary folder)")
    args = parser.parse_args(argv)
    if not args.tiny:
        parser.print_help()
        return 2
    out = args.out or tempfile.mkdtemp(prefix=f"benchmarks-{entry.name}-")
    os.makedirs(out, exist_ok=True)
    question, *rest = entry.tiny
    rc = run(entry, [question, *(arg.format(out=out) for arg in rest)])
    print(f"{entry.name} --tiny: results in {out}", flush=True)
    return rc
