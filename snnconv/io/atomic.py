"""The atomic file writer every snnconv file goes through: a temporary file, fsync, a rename;
and a folder of files written beside its destination and moved in once complete
(:class:`StagedFolder`)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Iterable

__all__ = ["atomic_write_text", "atomic_write_bytes", "stale_temporaries", "StagedFolder"]


_TMP_PREFIX = ".tmp-"


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _temporary_name(path: str) -> str:
    return f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(path)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_temporaries(path: str | os.PathLike) -> list[str]:
    """The temporary files that interrupted writes to ``path`` left beside it: named
    ``.tmp-<pid>-<random>-<name>`` with a ``<pid>`` that is no longer running on this machine."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(_TMP_PREFIX) + r"(\d+)-[0-9a-f]{8}-"
                         + re.escape(os.path.basename(path)) + "$")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            found.append(os.path.join(folder, name))
    return sorted(found)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Guarantees: ``path`` holds either its previous content or all of ``data``, never a part
    (the data is fsynced before the rename, the folder after it). An exception during the write
    removes the temporary file. A process killed during the write (SIGKILL, power loss) can
    leave its temporary file, ``.tmp-<pid>-<random>-<name>`` beside ``path``; the next write to
    the same ``path`` removes every such file whose process is gone (see
    :func:`stale_temporaries`). A concurrent writer's temporary file is left alone.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    for stale in stale_temporaries(path):
        try:
            os.unlink(stale)
        except FileNotFoundError:  # another writer swept it first
            pass
    tmp = os.path.join(folder, _temporary_name(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode 0666 & ~umask
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StagedFolder:
    """The files of a folder ``dest`` written first into a hidden sibling
    (``.<name>.partial-<pid>-<random>``, made on first use of :attr:`path`), and moved into
    ``dest`` only by :meth:`commit`, once all of them are written.

    Until then ``dest`` is untouched: an interruption (Ctrl-C, an error) leaves it as it was and
    removes the sibling (``with StagedFolder(...)`` discards on any exception). :meth:`commit`
    renames the sibling to ``dest`` where ``dest`` does not exist (one atomic rename); else it
    moves ``replaces`` (names in ``dest``: an old run's files and folders) aside, moves each
    new entry in with a rename, and removes the old ones. Other entries of ``dest`` are left
    where they are.
    """

    def __init__(self, dest: str | os.PathLike, replaces: Iterable[str] = ()):
        self.dest = os.fspath(dest)
        self.replaces = list(replaces)
        self._path: str | None = None

    @property
    def path(self) -> str:
        """The folder to write into (made here on first use, beside ``dest``)."""
        if self._path is None:
            parent = os.path.dirname(os.path.abspath(self.dest))
            os.makedirs(parent, exist_ok=True)
            name = f".{os.path.basename(os.path.abspath(self.dest))}.partial-{os.getpid()}-{secrets.token_hex(4)}"
            self._path = os.path.join(parent, name)
            os.mkdir(self._path)
        return self._path

    def commit(self) -> None:
        """Move the written files into ``dest`` (see the class docstring)."""
        new = self.path
        if not os.path.lexists(self.dest):
            os.rename(new, self.dest)
        else:
            old = new + ".old"
            os.mkdir(old)
            for name in self.replaces:
                if os.path.lexists(os.path.join(self.dest, name)):
                    os.rename(os.path.join(self.dest, name), os.path.join(old, name))
            for name in os.listdir(new):
                os.replace(os.path.join(new, name), os.path.join(self.dest, name))
            os.rmdir(new)
            shutil.rmtree(old, ignore_errors=True)
        self._path = None
        _fsync_folder(os.path.dirname(os.path.abspath(self.dest)))

    def discard(self) -> None:
        """Remove what was written (``dest`` stays as it was)."""
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None

    def __enter__(self) -> "StagedFolder":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.discard()  # committed: nothing left to discard
