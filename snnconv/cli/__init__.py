"""The ``snnconv`` command line: one tool, shared flags, exit codes scripts can rely on.

    snnconv demo                                       digits -> small CNN -> SNN, in a minute
    snnconv convert --model small_cnn --data digits --train-epochs 30 --out runs/d
    snnconv finetune runs/d --data digits --T 4 --epochs 2
    snnconv export runs/d && snnconv run runs/d/snn.nir --backend cpu --data digits
    snnconv calibrate-exit runs/d --data digits        early exit: each image stops when its answer is sure
    snnconv diagnose runs/d --data digits              where the accuracy goes, layer by layer
    snnconv report runs/d                              one HTML page with every plot
    snnconv convert --model mynets:build --weights w.pt --data images/ --image-size 32 --out runs/m
                                                       your own model (a factory) and image folder

Exit codes: 0 success, 1 a check failed (``check``: BatchNorm remains), 2 a usage or input
error, 3 an unexpected error (out of memory, say), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM). Every error is one line on stderr, ``snnconv COMMAND: error: ...``, without a
traceback or terminal escape codes (``SNNCONV_TRACEBACK=1`` shows the traceback of an
unexpected error). On Ctrl-C or SIGTERM, what a command started (Lava's worker processes,
temporary files) is cleaned up before it exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from snnconv.cli import check, convert, evaluate, nir
from snnconv.cli.common import Parser, UsageError, check_device, one_line, parents, recorded_data

__all__ = ["main", "build_parser"]

#: The subcommands, in the order ``snnconv --help`` lists them: each adds its parser.
COMMANDS = (convert.add_demo, convert.add_convert, convert.add_finetune, evaluate.add_evaluate,
            evaluate.add_calibrate_exit, evaluate.add_diagnose, check.add_check, evaluate.add_report, nir.add_export,
            nir.add_inspect, nir.add_run, nir.add_backends)


def build_parser() -> argparse.ArgumentParser:
    """The ``snnconv`` parser: one subcommand per task, shared flags from :func:`common.parents`."""
    from snnconv import __version__

    pa = parents()
    parser = Parser(prog="snnconv", description=__doc__.replace("``", ""),  # plain text, not reST
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"snnconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub, pa)
    parser.commands = sub.choices  # type: ignore[attr-defined]  # name -> the subcommand's parser
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that its cleanup runs as for Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (0 ok, 1 a check failed, 2 usage or input error,
    3 unexpected error, 130 interrupted, 143 terminated)."""
    from snnconv.errors import SnnconvError

    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the subcommand, whose flags they are not
            commands = parser.commands  # type: ignore[attr-defined]
            commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version (0) or a usage error (argparse printed one line: 2)
        return exc.code if isinstance(exc.code, int) else 2
    where = f"snnconv {args.command}"
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        check_device(getattr(args, "device", None))
        recorded_data(args)
        return args.func(args)
    except (UsageError, SnnconvError, OSError, ValueError) as exc:
        print(f"{where}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{where}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or the machine (out of memory): still one line
        if os.environ.get("SNNCONV_TRACEBACK"):
            raise
        print(f"{where}: error: unexpected {type(exc).__name__}: {one_line(exc)[:500]} "
              "(SNNCONV_TRACEBACK=1 shows where)", file=sys.stderr)
        return 3
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
