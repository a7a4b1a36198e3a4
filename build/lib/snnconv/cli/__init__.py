"""The ``snnconv`` command line: one tool, shared flags, exit codes scripts can rely on.

    snnconv demo                                       digits -> small CNN -> SNN, in a minute
    snnconv convert --model small_cnn --data digits --train-epochs 30 --out runs/d
    snnconv finetune runs/d --data digits --T 4 --epochs 2
    snnconv export runs/d && snnconv run runs/d/snn.nir --backend cpu --data digits
    snnconv report runs/d                              one HTML page with every plot

Exit codes: 0 success, 1 a check failed (``check``: BatchNorm remains), 2 a usage or input
error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys

from . import check, convert, evaluate, nir
from .common import Parser, UsageError, parents

__all__ = ["main", "build_parser"]

#: The subcommands, in the order ``snnconv --help`` lists them: each adds its parser.
COMMANDS = (convert.add_demo, convert.add_convert, convert.add_finetune, evaluate.add_evaluate,
            check.add_check, evaluate.add_report, nir.add_export, nir.add_inspect, nir.add_run,
            nir.add_backends)


def build_parser() -> argparse.ArgumentParser:
    """The ``snnconv`` parser: one subcommand per task, shared flags from :func:`common.parents`."""
    from .. import __version__

    pa = parents()
    parser = Parser(prog="snnconv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"snnconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub, pa)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (0 ok, 1 a check failed, 2 usage or input error)."""
    from ..errors import SnnconvError

    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints one line and exits 2
    try:
        return args.func(args)
    except (UsageError, SnnconvError, OSError, ValueError) as exc:
        print(f"snnconv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"snnconv {args.command}: interrupted", file=sys.stderr)
        return 130
