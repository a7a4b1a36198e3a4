"""Content digests of snnconv's files, and the warning for a file that cannot be verified.

:func:`content_digest` hashes a value's *content*, not its serialised bytes: the same nested
dicts, lists, strings, numbers and arrays give the same digest whatever file format carried
them. ``SpikingNetwork`` files and NIR files store it beside their content and check it on
load, so a changed byte is an error rather than a changed network.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

__all__ = ["content_digest", "UnverifiedFileWarning"]


class UnverifiedFileWarning(UserWarning):
    """A file in snnconv's format that carries no digest (written by an older snnconv, or
    edited): it was read and checked for structure, but its values cannot be verified."""


def content_digest(value: Any) -> str:
    """``"sha256:<hex>"`` of ``value``'s content.

    Dict keys are sorted; lists and tuples hash alike; strings and ``bytes`` hash as UTF-8
    text; python ints and floats hash their exact value with their type (``1`` and ``1.0``
    differ); numpy and torch arrays and scalars their dtype, shape and bytes. ``None`` and
    booleans have their own tags.

    Raises:
        TypeError: a value of another type (named).
    """
    h = hashlib.sha256()
    _feed(h, value)
    return "sha256:" + h.hexdigest()


def _tag(h: Any, tag: bytes, payload: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(payload)) + payload)


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, dict):
        _tag(h, b"d", str(len(value)).encode())
        for key in sorted(value, key=str):
            _tag(h, b"k", str(key).encode("utf-8"))
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        _tag(h, b"l", str(len(value)).encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, (str, bytes)):
        _tag(h, b"s", value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass"))
    elif value is None:
        _tag(h, b"n", b"")
    elif isinstance(value, (bool, np.bool_)):
        _tag(h, b"b", b"1" if value else b"0")
    elif type(value) is int:
        _tag(h, b"i", str(value).encode())
    elif type(value) is float:
        _tag(h, b"f", value.hex().encode())
    elif hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch tensor
        t = value.detach().cpu().contiguous()
        _tag(h, b"t", f"{t.dtype}{tuple(t.shape)}".encode())
        _tag(h, b"v", t.reshape(-1).view(_torch_uint8()).numpy().tobytes())
    elif isinstance(value, (np.generic, np.ndarray)):
        a = np.asarray(value)
        if a.dtype.kind == "O":  # h5py reads string arrays as objects
            _tag(h, b"o", str(a.shape).encode())
            for item in a.reshape(-1):
                _feed(h, item)
            return
        a = np.ascontiguousarray(a)
        _tag(h, b"a", f"{a.dtype.str}{a.shape}".encode())
        _tag(h, b"v", a.tobytes())
    else:
        raise TypeError(f"content_digest cannot hash a value of type {type(value).__name__}")


def _torch_uint8() -> Any:
    import torch

    return torch.uint8
