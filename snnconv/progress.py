"""Progress bars that do not flood logs.

On a terminal, :func:`progress_bar` is a ``tqdm`` bar (elapsed and remaining time where the
total is known). When stderr is not a terminal (CI, output redirected to a file), it is a
:class:`LogProgress`: one plain line when the bar closes (a batch loop: one line per epoch), one
after :data:`FIRST_LINE` seconds and at most one every ``interval`` seconds before that, each
with the time elapsed and, where the total is known, the time left; instead of tqdm's rewrite
per update that leaves thousands of lines in a log.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, Sized

from tqdm.auto import tqdm

__all__ = ["progress_bar", "LogProgress", "LOG_INTERVAL", "FIRST_LINE", "duration"]

#: Seconds between two progress lines when stderr is not a terminal.
LOG_INTERVAL = 30.0
#: Seconds after which a loop that is still running writes its first line (with the time left).
FIRST_LINE = 5.0


def duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 20 s"``, ``"2 h 05 min"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{max(seconds, 0):.0f} s" if seconds >= 1 else f"{max(seconds, 0):.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class LogProgress:
    """A log-friendly stand-in for the part of tqdm's API the stages use.

    ``update``, ``set_postfix``, ``close``, iteration and ``with``; writes
    ``"desc: n/total [12 s elapsed, about 40 s left] postfix"`` lines to ``file`` (default
    ``sys.stderr``): once after ``first`` seconds, then at most every ``interval`` seconds, and
    once at ``close()``. The time left is the pace so far applied to what remains (``total``
    known, at least one update since ``initial``).
    """

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None,
                 desc: str = "", initial: int = 0, interval: float = LOG_INTERVAL,
                 first: float = FIRST_LINE, file: Any = None, **_: Any):
        self.iterable = iterable
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self.total, self.desc, self.n, self.initial = total, desc, int(initial), int(initial)
        self.interval, self.first = float(interval), float(first)
        self.file = file
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def _write(self) -> None:
        out = self.file if self.file is not None else sys.stderr
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        print(f"{self.desc}: {count} [{self.times()}]" + (f" {self.postfix}" if self.postfix else ""),
              file=out, flush=True)

    def times(self) -> str:
        """``"12 s elapsed, about 40 s left"`` (the time left where it can be estimated)."""
        elapsed = time.monotonic() - self.start
        text = f"{duration(elapsed)} elapsed"
        done = self.n - self.initial
        if self.total is not None and done > 0 and self.n < self.total:
            text += f", about {duration(elapsed / done * (self.total - self.n))} left"
        return text

    def update(self, n: int = 1) -> None:
        """Advance by ``n``; writes a line if ``interval`` seconds passed since the last one."""
        self.n += n
        now = time.monotonic()
        wait = self.first if self.last == self.start else self.interval
        if now - self.last >= wait:
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
            for item in () if self.iterable is None else self.iterable:
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
        return iter(() if self.iterable is None else self.iterable)

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
