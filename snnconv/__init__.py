"""snnconv: convert trained ReLU networks into spiking networks of IF neurons.

    snn, meta = snnconv.convert(model, loader)

runs prepare -> fold BatchNorm -> QCFS calibration -> IF replacement -> (BPTT fine-tuning),
with a no-BatchNorm guard between every two stages.

The names below are imported on first use (PEP 562), so that ``import snnconv.errors`` (which
the backends do) loads no conversion stage.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import logging as _logging

__version__ = "0.1.0"

# spikingjelly asks torch for Triton at import and logs "Triton not available" twice on CPU.
_logging.getLogger("spikingjelly").setLevel(_logging.ERROR)

#: Public name -> the submodule that defines it (``backends`` is the submodule itself).
_EXPORTS: dict[str, str] = {
    "convert": "pipeline",
    "ConvertConfig": "config",
    "fold_batchnorm": "stages.fold",
    "assert_no_batchnorm": "guards",
    "find_batchnorm": "guards",
    "calibrate_qcfs": "stages.qcfs",
    "to_spiking": "stages.spiking",
    "finetune": "stages.finetune",
    "diagnose": "analysis.diagnosis",
    "calibrate_exit": "analysis.early_exit",
    "evaluate_exit": "analysis.early_exit",
    "ExitRule": "exit_rule",
    "export_nir": "snn.nir_io",
    "from_nir": "snn.nir_io",
    "save_nir": "snn.prefixfile",
    "load_nir": "snn.prefixfile",
    "QCFS": "stages.qcfs",
    "QCFSTrainConfig": "stages.qcfs",
    "FinetuneConfig": "stages.finetune",
    "IFNeuron": "snn.neuron",
    "SpikingNetwork": "snn.network",
    "ConversionMeta": "meta",
    "SnnconvError": "errors",
    "FoldError": "errors",
    "BatchNormRemainsError": "errors",
    "UnsupportedLayerError": "errors",
    "UnsupportedModelError": "errors",
    "DataError": "errors",
    "ConfigError": "errors",
    "StageOrderError": "errors",
    "CheckpointError": "errors",
    "NIRError": "errors",
    "BackendError": "errors",
    "backends": "backends",
    "ConversionError": "errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first use; any submodule by its name."""
    if name in _EXPORTS:
        module = _importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = module if name == "backends" else getattr(module, name)
        globals()[name] = value
        return value
    if not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'snnconv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

