"""One exception hierarchy for snnconv.

Every message says what was found, where (a qualified module name or an fx node) and what to do.
"""

from __future__ import annotations

__all__ = [
    "SnnconvError",
    "FoldError",
    "BatchNormRemainsError",
    "UnsupportedLayerError",
    "UnsupportedModelError",
    "DataError",
    "ConfigError",
    "ResourceError",
    "StageOrderError",
    "CheckpointError",
    "NIRError",
    "BackendError",
    "ConversionError",
]


class SnnconvError(Exception):
    """Root of every error snnconv raises on purpose."""


class FoldError(SnnconvError):
    """A BatchNorm cannot be folded into the layer that feeds it."""


class BatchNormRemainsError(SnnconvError):
    """A graph that must be free of BatchNorm still holds some.

    Attributes:
        offenders: one ``"where: what"`` string per BatchNorm found.
    """

    def __init__(self, message: str, offenders: list[str] | None = None):
        super().__init__(message)
        self.offenders = list(offenders or [])


class UnsupportedLayerError(SnnconvError):
    """A layer or call the conversion cannot turn into a spiking equivalent.

    Attributes:
        found: where one error lists several, each of them (a :class:`snnconv.refusals.Construct`:
            kind, module path, fx node, what it is).
    """

    def __init__(self, message: str, found: list | None = None):
        super().__init__(message)
        self.found = list(found or [])


class UnsupportedModelError(SnnconvError):
    """A model as a whole cannot be handled (for example, torch.fx cannot trace it)."""


class DataError(SnnconvError, ValueError):
    """Data (a loader, a batch, a dataset on disk) is missing or unusable."""


class ConfigError(SnnconvError, ValueError):
    """An argument or setting is out of range, of the wrong type, or contradicts another one
    (a ``ValueError`` too, so that ``except ValueError`` keeps working)."""


class ResourceError(SnnconvError, MemoryError):
    """A stage needs more memory than the machine has: refused with the estimate where one is
    made beforehand, reported with the stage where an allocation failed, and what to lower."""


class StageOrderError(SnnconvError):
    """A stage was given a graph that an earlier stage should have produced but did not."""


class CheckpointError(SnnconvError):
    """A checkpoint is corrupted, truncated or belongs to another model or run."""


class NIRError(SnnconvError):
    """A NIR graph or file is malformed, or holds something snnconv cannot read or write exactly.

    The message names the node, edge, module or file concerned.
    """


class BackendError(SnnconvError):
    """A backend cannot run what it was given: an unknown or unavailable backend, a NIR node or
    option it does not support, or an input of the wrong shape, dtype or number of steps."""


class ConversionError(SnnconvError):
    """A stage left a collapsed network: layers silent or saturated on all calibration data,
    or a network at chance where the ANN is not.

    Attributes:
        layers: one finding per problem, naming the layers (``"silent (...): qcfs_relu_3"``).
    """

    def __init__(self, message: str, layers: list[str] | None = None):
        super().__init__(message)
        self.layers = list(layers or [])
