"""snnconv's NIR encoding, defined once: the writer (:mod:`snnconv.nir_io`) and the reader every
executor shares (:mod:`snnconv_backends.nirgraph`) both use these names and functions.

A leaf module (numpy only), so that the backends can import it without loading a stage.

Graph metadata: ``{"producer": "snnconv", "snnconv_format": FORMAT_VERSION, "T": T,
"reset": "subtract" | "zero", "encoding": "direct", "readout": "mean_over_T"}``.

Neuron metadata (on the ``I`` of the subtractive pattern, or on the ``IF`` of a hard-reset site):
``{"snnconv_neuron": "if", "reset": ..., "v_init": ..., "compare": COMPARE, "threshold":
"per_layer" | "per_channel"}``. ``v_init`` is in units of theta: the number ``0.5`` for QCFS's
shift, a list (per layer or channel) for calibrated ones, ``0.0`` for hard reset.

Other markers: ``Scale`` of ones with ``{"snnconv_op": "sum"}`` is a sum node (nir 1.0.8 cannot
write ``Identity``); ``AvgPool2d`` with ``{"snnconv_module": "AdaptiveAvgPool2d"}`` rounds as
torch's adaptive pooling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ConfigError

__all__ = ["FORMAT_VERSION", "PRODUCER", "RESETS", "COMPARE", "NEURON_KEY", "OP_KEY", "MODULE_KEY",
           "SUM_OP", "ADAPTIVE_AVGPOOL", "fire_threshold", "neuron_metadata", "graph_metadata",
           "v_init_metadata"]

#: graph metadata key "snnconv_format"
FORMAT_VERSION = 1
PRODUCER = "snnconv"
#: the reset kinds a file may state
RESETS = ("subtract", "zero")
#: snnconv's neurons fire on h >= theta (NIR's Threshold alone fires on h > theta)
COMPARE = ">="
NEURON_KEY = "snnconv_neuron"
OP_KEY = "snnconv_op"
MODULE_KEY = "snnconv_module"
SUM_OP = "sum"
ADAPTIVE_AVGPOOL = "AdaptiveAvgPool2d"


def fire_threshold(theta: np.ndarray, v_init: np.ndarray) -> np.ndarray:
    """The Threshold of a subtractive neuron whose integrator starts at 0: ``theta * (1 -
    v_init)`` in float32 (``theta / 2`` exactly for ``v_init = 1/2``). Writer and reader both
    compute it here, so the file's value is checked bit for bit."""
    theta = np.asarray(theta, dtype=np.float32)
    return (theta * (np.float32(1) - np.asarray(v_init, dtype=np.float32))).astype(np.float32)


def v_init_metadata(v_init: np.ndarray) -> float | list[float]:
    """``v_init`` (units of theta) as written: the number 0.5 for QCFS's shift, else a list."""
    v = np.asarray(v_init, dtype=np.float32)
    return 0.5 if v.ndim == 0 and float(v) == 0.5 else [float(x) for x in v.reshape(-1)]


def neuron_metadata(reset: str, v_init: Any, per_channel: bool) -> dict[str, Any]:
    """The metadata of one neuron site (see the module docstring)."""
    if reset not in RESETS:
        raise ConfigError(f"reset {reset!r} is not one of {RESETS}")
    return {NEURON_KEY: "if", "reset": reset, "v_init": v_init, "compare": COMPARE,
            "threshold": "per_channel" if per_channel else "per_layer"}


def graph_metadata(T: int, reset: str) -> dict[str, Any]:
    """The graph metadata of an snnconv file."""
    return {"producer": PRODUCER, "snnconv_format": FORMAT_VERSION, "T": int(T), "reset": reset,
            "encoding": "direct", "readout": "mean_over_T"}
