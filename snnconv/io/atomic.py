"""The atomic file writer every snnconv file goes through: a temporary file, fsync, a rename."""

from __future__ import annotations

import os
import re
import secrets

__all__ = ["atomic_write_text", "atomic_write_bytes", "stale_temporaries"]


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
