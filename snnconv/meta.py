"""ConversionMeta: what each stage did, how long it took, and with which environment; and the
atomic file writer every snnconv file goes through."""

from __future__ import annotations

import json
import os
import platform
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StageRecord", "ConversionMeta", "environment", "atomic_write_text", "atomic_write_bytes",
           "stale_temporaries", "jsonable"]


def environment() -> dict[str, str]:
    """Versions of the packages a conversion depends on."""
    import numpy
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "numpy": numpy.__version__}
    for mod in ("spikingjelly", "nir"):
        try:
            from importlib.metadata import version

            env[mod] = version(mod)
        except Exception:
            env[mod] = "not installed"
    from . import __version__

    env["snnconv"] = __version__
    return env


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


@dataclass
class StageRecord:
    """One stage of the pipeline: its name, wall time and what it changed."""

    name: str
    seconds: float = 0.0
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConversionMeta:
    """Per-stage records of one conversion, plus environment, seed and settings."""

    stages: list[StageRecord] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    environment: dict[str, str] = field(default_factory=environment)
    accuracy: dict[str, Any] = field(default_factory=dict)
    #: Before training-style work: the stages, steps and estimated seconds on this device
    #: (:class:`snnconv.plan.Plan`); empty where none ran.
    plan: dict[str, Any] = field(default_factory=dict)

    def stage(self, name: str) -> StageRecord:
        """The record of stage ``name`` (KeyError if it did not run)."""
        for record in self.stages:
            if record.name == name:
                return record
        raise KeyError(f"no stage '{name}' in this conversion; stages: {[s.name for s in self.stages]}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | os.PathLike | None = None, indent: int = 2) -> str:
        """Serialise to JSON; also write it atomically to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent, default=jsonable)
        if path is not None:
            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConversionMeta":
        stages = [StageRecord(**s) for s in data.get("stages", [])]
        return cls(stages=stages, settings=dict(data.get("settings", {})), seed=data.get("seed"),
                   environment=dict(data.get("environment", {})),
                   accuracy=dict(data.get("accuracy", {})), plan=dict(data.get("plan", {})))

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "ConversionMeta":
        """Read from a JSON string or a path to a JSON file."""
        text = os.fspath(text_or_path)
        if not text.lstrip().startswith("{"):
            with open(text) as fh:
                text = fh.read()
        return cls.from_dict(json.loads(text))


def jsonable(obj: Any) -> Any:
    """``json.dumps(..., default=jsonable)``: tensors and arrays as lists, anything else as its str."""
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
