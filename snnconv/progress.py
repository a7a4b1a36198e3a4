"""Progress bars that do not flood logs.

On a terminal, :func:`progress_bar` is a ``tqdm`` bar. When stderr is not a terminal (CI,
output redirected to a file), it is a :class:`LogProgress`: one plain line when the bar closes
(a batch loop: one line per epoch) and at most one line every ``interval`` seconds before
that, instead of tqdm's rewrite per update that leaves thousands of lines in a log.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator

from tqdm.auto import tqdm

__all__ = ["progress_bar", "LogProgress", "LOG_INTERVAL"]

#: Seconds between two progress lines when stderr is not a terminal.
LOG_INTERVAL = 30.0


class LogProgress:
    """A log-friendly stand-in for the part of tqdm's API the stages use.

    ``update``, ``set_postfix``, ``close``, iteration and ``with``; writes
    ``"desc: n/total [elapsed, ~remaining left] postfix"`` lines (the remaining time where the
    total is known, from the rate so far) to ``file`` (default ``sys.stderr``) at most every
    ``interval`` seconds and once at ``close()``.
    """

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None,
                 desc: str = "", initial: int = 0, interval: float = LOG_INTERVAL,
                 file: Any = None, **_: Any):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.n, self.initial = total, desc, int(initial), int(initial)
        self.interval = float(interval)
        self.file = file
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def _write(self) -> None:
        out = self.file if self.file is not None else sys.stderr
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        elapsed = time.monotonic() - self.start
        timing = f"{elapsed:.0f}s"
        done = self.n - self.initial
        if self.total is not None and 0 < done and self.n < self.total and not self.closed:
            timing += f", ~{elapsed / done * (self.total - self.n):.0f}s left"
        line = f"{self.desc}: {count} [{timing}]" + (f" {self.postfix}" if self.postfix else "")
        print(line, file=out, flush=True)

    def update(self, n: int = 1) -> None:
        """Advance by ``n``; writes a line if ``interval`` seconds passed since the last one."""
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write()

    def set_postfix(self, ordered_dict: dict | None = None, **kwargs: Any) -> None:
        """Values shown after the count (``loss=0.3``), like tqdm's."""
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self) -> None:
        """Write the final line (once)."""
        if not self.closed:
            self.closed = True
            self._write()

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Silent:
    """A disabled bar: iterates, ignores everything else."""

    def __init__(self, iterable: Iterable | None = None, **_: Any):
        self.iterable = iterable

    def update(self, n: int = 1) -> None:  # noqa: D102
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        pass

    def close(self) -> None:  # noqa: D102
        pass

    def __iter__(self) -> Iterator:
        return iter(self.iterable)

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(iterable: Iterable | None = None, *, disable: bool = False, **kwargs: Any):
    """A tqdm bar on a terminal, a :class:`LogProgress` otherwise, nothing when ``disable``."""
    if disable:
        return _Silent(iterable)
    if _is_terminal(kwargs.get("file") or sys.stderr):
        return tqdm(iterable, **kwargs)
    kwargs.pop("leave", None)
    return LogProgress(iterable, **kwargs)
