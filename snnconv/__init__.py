"""snnconv: convert trained ReLU networks into spiking networks of IF neurons.

    snn, meta = snnconv.convert(model, loader)

runs prepare -> fold BatchNorm -> QCFS calibration -> IF replacement -> (BPTT fine-tuning),
with a no-BatchNorm guard between every two stages.
"""

import logging as _logging

__version__ = "0.1.0"

# spikingjelly asks torch for Triton at import and logs "Triton not available" twice on CPU.
_logging.getLogger("spikingjelly").setLevel(_logging.ERROR)

from .errors import (  # noqa: E402
    BackendError,
    BatchNormRemainsError,
    CheckpointError,
    ConversionError,
    DataError,
    FoldError,
    NIRError,
    SnnconvError,
    StageOrderError,
    UnsupportedLayerError,
    UnsupportedModelError,
)
from .finetune import FinetuneConfig, finetune  # noqa: E402
from .fold import fold_batchnorm  # noqa: E402
from .guards import assert_no_batchnorm, find_batchnorm  # noqa: E402
from .meta import ConversionMeta  # noqa: E402
from .network import SpikingNetwork  # noqa: E402
from .neuron import IFNeuron  # noqa: E402
from .nir_io import export_nir, from_nir, load_nir, save_nir  # noqa: E402
from .pipeline import convert  # noqa: E402
from .qcfs import QCFS, QCFSTrainConfig, calibrate_qcfs  # noqa: E402
from .replace import to_spiking  # noqa: E402

__all__ = [
    "__version__",
    "convert",
    "fold_batchnorm",
    "assert_no_batchnorm",
    "find_batchnorm",
    "calibrate_qcfs",
    "to_spiking",
    "finetune",
    "export_nir",
    "from_nir",
    "save_nir",
    "load_nir",
    "QCFS",
    "QCFSTrainConfig",
    "FinetuneConfig",
    "IFNeuron",
    "SpikingNetwork",
    "ConversionMeta",
    "SnnconvError",
    "FoldError",
    "BatchNormRemainsError",
    "UnsupportedLayerError",
    "UnsupportedModelError",
    "DataError",
    "StageOrderError",
    "CheckpointError",
    "NIRError",
    "BackendError",
    "backends",
    "ConversionError",
]


def __getattr__(name: str):
    # ``snnconv.backends`` is imported on first use: snnconv_backends imports snnconv.errors, so
    # importing it here eagerly would make ``import snnconv_backends`` (first) circular.
    if name == "backends":
        import importlib

        return importlib.import_module(".backends", __name__)
    raise AttributeError(f"module 'snnconv' has no attribute {name!r}")
