"""ConversionMeta: what each stage did, how long it took, and with which environment."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StageRecord", "ConversionMeta", "environment", "atomic_write_text", "atomic_write_bytes",
           "jsonable"]


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (never half-written)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            # mkstemp creates the file 0600; give it the mode open() would give (0666 & ~umask)
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
                   accuracy=dict(data.get("accuracy", {})))

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
