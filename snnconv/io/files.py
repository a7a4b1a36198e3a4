"""Opening files from strangers: only regular files, of a bounded size, and the read budget.

Every reader of snnconv's files (NIR files, prefix files, network files, checkpoints) opens its
file with :func:`open_regular`: a FIFO, a device, a socket or a folder is refused by name
instead of blocking or streaming forever, and a file larger than its reader's bound is refused
before a byte is read.

The read budget
---------------

:data:`MAX_FILE_BYTES` (1 GiB) is the one memory budget for reading any snnconv file: the most
bytes a file may hold, and the most bytes of data all of its arrays together may declare (what
reading them allocates: a dataset's dtype size times its shape, a fixed-length string at its
declared length, a compressed array at its size once inflated). A reader refuses a file past it
before reading its data, so one load allocates a small multiple of the budget at worst (the
values read, then the arrays built from them), whatever the file declares.

The largest legitimate networks it admits, at float32 (4 bytes per parameter; an SNN adds one
threshold per channel, a few KiB):

- a torchvision ResNet-50: 25.6 M parameters, 102 MB: 10.5 times under the budget;
- a torchvision VGG-16: 138.4 M parameters, 553 MB: 1.9 times under it;
- the largest: 2**30 / 4 = 268 M float32 parameters (``MAX_VALUES`` of :mod:`snnconv.nir.file`
  counts the same bound in values).

Reading a NIR file of VGG-16's size peaks at 1.3 GiB (2.4 times its 528 MiB of values: the
values, their digest, the parser's float32 arrays; ``python -m benchmarks interop nir_file_attacks --admit``).
A larger network is read by passing a larger bound to its reader (``load_nir(...,
max_bytes=N)``), never by default.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat

from snnconv.errors import SnnconvError

__all__ = ["MAX_FILE_BYTES", "open_regular", "file_kind"]

#: The read budget of every snnconv file reader, in bytes (see the module docstring)
MAX_FILE_BYTES = 2**30

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What ``st_mode`` describes, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, max_bytes: int | float = MAX_FILE_BYTES, *,
                 error: type[SnnconvError] = SnnconvError, what: str = "file") -> io.BufferedReader:
    """Open ``path`` for reading in binary mode, if it is a regular file of at most ``max_bytes``.

    The file is opened without blocking (``O_NONBLOCK``: opening a FIFO with no writer returns
    at once) and checked on the open descriptor (``fstat``), so the file checked is the file
    read, whatever replaces the path meanwhile; then the descriptor blocks again as usual.

    Args:
        path: the file (a symbolic link to a regular file is followed).
        max_bytes: the largest size accepted.
        error: the exception raised (a :class:`snnconv.errors.SnnconvError`, e.g. ``NIRError``).
        what: what the file is, for the messages ("NIR file", "analog prefix file").

    Returns:
        the open file (a ``with`` block closes it).

    Raises:
        ``error``: the path is missing or unreadable, is a folder, FIFO, socket or device, or
            holds more than ``max_bytes`` bytes (each message names the path).
    """
    where = os.fspath(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise error(f"{where}: no such {what}") from None
        try:  # a socket cannot be opened at all (ENXIO): say what it is
            mode = os.stat(where).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise error(f"{where} is {file_kind(mode)}, not a regular file; snnconv reads the "
                        f"{what} only from a regular file") from None
        raise error(f"{where}: cannot open the {what}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{where} is {file_kind(info.st_mode)}, not a regular file; snnconv reads "
                        f"the {what} only from a regular file")
        if info.st_size > max_bytes:
            raise error(f"{where}: {info.st_size} bytes, more than the {int(max_bytes)} bytes a "
                        f"{what} may hold (the read budget); nothing was read")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise

