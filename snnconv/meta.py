"""ConversionMeta: what each stage did, how long it took, and with which environment."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

from snnconv.io.atomic import atomic_write_text

__all__ = ["StageRecord", "ConversionMeta", "environment", "jsonable"]


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
    from snnconv import __version__

    env["snnconv"] = __version__
    return env


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
    #: (:class:`snnconv.plan.WorkEstimate`); empty where none ran.
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
