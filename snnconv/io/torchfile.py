"""Reading untrusted ``torch.save`` files (networks, prefixes, fine-tuning checkpoints, users'
state dicts) within :data:`snnconv.io.files.MAX_FILE_BYTES`.

Before anything is unpickled: the path is a regular file (a FIFO or a device would block or
never end), the file fits the budget, it is a zip archive (torch's format since 1.6), and its
entries inflate to no more than the budget together (torch.save stores them uncompressed; a
small file of deflated zeros is refused before ``torch.load`` inflates it). Then
``torch.load(weights_only=True)`` (no code), and the result is plain data: dense tensors,
containers nested at most :data:`MAX_NESTING` deep.
"""

from __future__ import annotations

import errno
import io
import os
import zipfile
from typing import Any

import torch

from snnconv.errors import CheckpointError
from snnconv.io.files import MAX_FILE_BYTES, open_regular

__all__ = ["MAX_NESTING", "read_regular", "load_untrusted"]

#: Containers (dicts, lists, tuples) within one another in a file; snnconv writes at most 8.
MAX_NESTING = 64


def read_regular(path: str | os.PathLike, what: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them
    (:func:`snnconv.io.files.open_regular`).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: ``path`` is not a regular file (a folder, FIFO, device or socket), or
            larger than ``max_bytes`` (``what`` names the file's role in the message).
    """
    where = os.fspath(path)
    if not os.path.lexists(where):
        raise FileNotFoundError(errno.ENOENT, f"no such {what}", where)
    with open_regular(where, max_bytes, error=CheckpointError, what=what) as fh:
        size = os.fstat(fh.fileno()).st_size  # within max_bytes: open_regular checked it
        data = fh.read(size + 1)  # one byte more shows a file that grew (a buffer of the file's size)
    if len(data) > max_bytes:
        raise CheckpointError(f"{where} grew past {max_bytes:,} bytes while it was read")
    return data


def _check_archive(where: str, data: bytes, max_bytes: int) -> None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"cannot read {where} as a torch.save file (not a zip archive: {exc})") from None
    inflated = sum(e.file_size for e in entries)
    if inflated > max_bytes:
        raise CheckpointError(f"{where}: its {len(entries)} entries inflate to {inflated:,} bytes, "
                              f"more than the {max_bytes:,} that snnconv reads from one file; "
                              "refused before anything was inflated")


def _check_plain(where: str, value: Any) -> None:
    """Dense tensors and plain values in containers at most MAX_NESTING deep (iteratively)."""
    stack = [(value, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_NESTING:
            raise CheckpointError(f"{where} nests containers more than {MAX_NESTING} deep")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
            stack.extend((k, depth + 1) for k in obj if not isinstance(k, str))
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, depth + 1) for v in obj)
        elif isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized or obj.is_complex():
                raise CheckpointError(f"{where} holds a {obj.layout} {obj.dtype} tensor; snnconv files "
                                      "hold dense real tensors only")


def load_untrusted(path: str | os.PathLike, what: str, data: bytes | None = None,
                   max_bytes: int = MAX_FILE_BYTES) -> Any:
    """``torch.load(weights_only=True)`` of the file at ``path`` (or of its bytes ``data``, already
    read with :func:`read_regular`), within ``max_bytes``; the result holds plain data only.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: a file that is not regular, too large, not a zip archive, inflates past
            the budget, cannot be loaded without running code, or holds sparse, quantised or
            complex tensors or containers nested too deep.
    """
    where = os.fspath(path)
    if data is None:
        data = read_regular(path, what, max_bytes)
    elif len(data) > max_bytes:
        raise CheckpointError(f"{where} has {len(data):,} bytes, more than the {max_bytes:,} that "
                              "snnconv reads from one file (snnconv.io.files.MAX_FILE_BYTES)")
    _check_archive(where, data, max_bytes)
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {where} as a {what}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from None
    _check_plain(where, value)
    return value
