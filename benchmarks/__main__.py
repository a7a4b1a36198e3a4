"""``python -m benchmarks ENTRY [QUESTION] [ARGS]``: run one of the entry points."""

from __future__ import annotations

import importlib
import sys

from . import ENTRIES


def main(argv: list[str] | None = None) -> int:
    """Run the entry point named by ``argv[0]`` with the rest; 2 where there is none."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ENTRIES:
        width = max(map(len, ENTRIES))
        print("usage: python -m benchmarks ENTRY [QUESTION] [ARGS]  (ENTRY --help lists its questions)\n\n"
              + "\n".join(f"  {name:<{width}}  {what}" for name, what in ENTRIES.items())
              + "\n\nexample:\n  python -m benchmarks matrix --tiny --out /tmp/matrix",
              file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
