"""snnconv's NIR encoding, defined once: the writer (:mod:`snnconv.snn.nir_io`) and the reader every
executor shares (:mod:`snnconv.nir.reader`) both use these names and functions.

A leaf module (numpy and snnconv.errors only), so that the backends can import it without loading
a stage.

Graph metadata: ``{"producer": "snnconv", "snnconv_format": FORMAT_VERSION, "T": T,
"reset": "subtract" | "zero", "encoding": "direct", "readout": "mean_over_T"}``.

Neuron metadata (on the ``I`` of the subtractive pattern, or on the ``IF`` of a hard-reset site):
``{"snnconv_neuron": "if", "reset": ..., "v_init": ..., "compare": ..., "threshold":
"per_layer" | "per_channel"}``, and ``"burst": B`` for a neuron that emits up to B spikes in
one step. ``v_init`` is in units of theta: the number ``0.5`` for QCFS's shift, a list (per
layer or channel) for calibrated ones, ``0.0`` for hard reset.

Burst neurons. A subtractive neuron with ``burst`` B > 1 fires its k-th spike of a step when its
membrane reaches k thresholds: B ``Threshold`` nodes ``X_fire``, ``X_fire2``, ..., ``X_fireB``
on the one integrator (thresholds :func:`fire_threshold` ``(theta, v_init, k)``), whose spikes a
``Scale`` of ones marked ``{"snnconv_op": "sum"}`` (``X_spikes``) adds up: the count, 0..B, is
what the reset ``Scale(-theta)`` and the next layers receive. Every node means what NIR's spec
says; only the count leaving ``X_spikes`` is graded (Loihi 2 carries it as a graded spike).

The comparison. snnconv's neurons fire on ``h >= theta``; NIR's ``IF`` and ``Threshold`` fire
on ``v > v_threshold``. snnconv's metadata states NIR's comparison, ``compare=">"``, and its
files write every threshold as :func:`spec_threshold` ``(theta) = nextafter(theta, 0)`` in
float32: for every float32 ``v``, ``v > nextafter(theta, 0)`` is ``v >= theta``, so each node
means exactly what NIR's spec says and that is snnconv's neuron, ties included. A reader that
fires on ``>=`` (spikingjelly) agrees with it except on a membrane exactly one float32 step
below theta. A node without snnconv's metadata means what NIR's spec says: ``v > v_threshold``
(a reader may apply ``>=`` instead, :data:`COMPARES`, to reproduce a producer that simulates
that). A file whose ``snnconv_format`` is not :data:`FORMAT_VERSION` is refused.

Files older than the reset value. Up to nir 1.0.5 (files whose ``version`` is below 1.0.6,
e.g. ``0.2.0`` from nir <= 1.0.4) ``IF`` was documented as resetting by subtraction
(``v - v_threshold``) and had no ``v_reset``; nir 1.0.8's reader fills in ``v_reset = 0``,
which would silently turn those networks into reset-to-zero ones. The file reader refuses such
an IF with :func:`legacy_if_reason` and records an older file's version under
:data:`SOURCE_VERSION_KEY` in the graph metadata, from which :func:`predates_v_reset` tells the
graph reader to apply (or refuse) that older meaning.

Time step. NIR is continuous time; a reader picks ``dt``. snnconv's neurons integrate their
input once per step with gain 1, i.e. ``r * dt = 1`` (:func:`integration_gain`): snnconv's own
files have ``r = 1`` (``dt = 1``), spikingjelly's default export ``r = 1 / dt = 1e4``.

The analog prefix. A network whose first layers see only the static input (a ResNet stem with
its max-pooling) runs them once, outside the graph: the graph's input is their output
(``metadata["input"] == "analog_prefix"``), and the prefix is a network file beside the NIR
file, named in ``metadata["analog_prefix_file"]`` with the SHA-256 of its bytes.

Other markers: ``Scale`` of ones with ``{"snnconv_op": "sum"}`` is a sum node (nir 1.0.8 cannot
write ``Identity``); ``AvgPool2d`` with ``{"snnconv_module": "AdaptiveAvgPool2d"}`` rounds as
torch's adaptive pooling; a 1x1 ``Conv2d`` (or a ``Linear``) with a diagonal weight, no bias
and ``{"snnconv_op": "scale"}`` is an identity shortcut's per-channel scale, written so because
readers without a ``Scale`` mapping (spikingjelly) run convolutions; it is exact (one nonzero
term per output). A 1x1 ``Conv2d`` (or a ``Linear``) with ``{"snnconv_op": "concat"}`` places one
part of a channel concatenation: a one-hot weight, no bias. Both carry each spike unchanged to
the weighted layer after them (into whose weights a chip folds them), so the energy counts charge
them nothing there.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from snnconv.errors import ConfigError
from snnconv.vocabulary import RESETS

__all__ = ["FORMAT_VERSION", "PRODUCER", "RESETS", "COMPARE", "COMPARES",
           "SPEC_COMPARE", "NEURON_KEY", "BURST_KEY", "SPIKES_SUFFIX", "OP_KEY", "MODULE_KEY", "SUM_OP",
           "SCALE_OP", "CONCAT_OP",
           "ADAPTIVE_AVGPOOL", "SOURCE_VERSION_KEY", "V_RESET_SINCE", "fire_threshold",
           "spec_threshold", "engine_threshold", "neuron_metadata", "graph_metadata",
           "v_init_metadata", "predates_v_reset", "legacy_if_reason", "integration_gain",
           "INPUT_KEY", "ANALOG_PREFIX", "PREFIX_FILE_KEY", "PREFIX_SHA256_KEY"]

#: graph metadata key "snnconv_format": the version written and read
FORMAT_VERSION = 2
PRODUCER = "snnconv"
#: the comparison written now: NIR's own (see the module docstring)
COMPARE = ">"
#: NIR's comparison, for nodes without snnconv's metadata
SPEC_COMPARE = ">"
#: the comparisons a reader may apply to IF nodes that state none (">=": a producer that
#: simulates ``v >= v_threshold``)
COMPARES = (">", ">=")
NEURON_KEY = "snnconv_neuron"
#: neuron metadata key: the most spikes a burst neuron emits in one step (absent: 1)
BURST_KEY = "burst"
#: the node after a burst neuron's Threshold nodes that sums their spikes (its name's suffix)
SPIKES_SUFFIX = "_spikes"
OP_KEY = "snnconv_op"
MODULE_KEY = "snnconv_module"
SUM_OP = "sum"
SCALE_OP = "scale"
CONCAT_OP = "concat"
ADAPTIVE_AVGPOOL = "AdaptiveAvgPool2d"
#: graph metadata key ``"input"``: :data:`ANALOG_PREFIX` where the graph's input is the output of
#: the network's static analog prefix (:mod:`snnconv.constructs.prefix`), run once per image outside the graph
INPUT_KEY = "input"
ANALOG_PREFIX = "analog_prefix"
#: graph metadata keys naming the prefix's network file (a file name beside the NIR file, no
#: folder) and the SHA-256 of its bytes
PREFIX_FILE_KEY = "analog_prefix_file"
PREFIX_SHA256_KEY = "analog_prefix_sha256"
#: graph metadata key under which the file reader records the file's nir version string
SOURCE_VERSION_KEY = "nir_file_version"
#: the first nir release whose IF, LIF and CubaLIF have v_reset (reset to it, not subtraction)
V_RESET_SINCE = (1, 0, 6)


def fire_threshold(theta: np.ndarray, v_init: np.ndarray, k: int = 1) -> np.ndarray:
    """The threshold, compared with ``>=``, of a subtractive neuron whose integrator starts at
    0: ``theta * (1 - v_init)`` in float32 (``theta / 2`` exactly for ``v_init = 1/2``); with
    ``k``, of its k-th spike in one step (a burst neuron): ``theta * (k - v_init)``. Writer and
    reader both compute it here, so the file's value is checked bit for bit."""
    theta = np.asarray(theta, dtype=np.float32)
    return (theta * (np.float32(k) - np.asarray(v_init, dtype=np.float32))).astype(np.float32)


def spec_threshold(theta: np.ndarray) -> np.ndarray:
    """The NIR threshold (fire on ``v > t``) of a neuron that fires on ``v >= theta``:
    ``t = nextafter(theta, 0)`` in float32, so that ``v > t`` is ``v >= theta`` for every
    float32 ``v``."""
    theta = np.asarray(theta, dtype=np.float32)
    return np.nextafter(theta, np.float32(0)).astype(np.float32)


def engine_threshold(threshold: np.ndarray, compare: str) -> np.ndarray:
    """The threshold, compared with ``>=`` (snnconv's executors), of a node that fires on
    ``v <compare> threshold``: the value itself for ``">="``, ``nextafter(threshold, +inf)`` in
    float32 for ``">"`` (so ``h >= engine`` is ``h > threshold`` for every float32 ``h``).

    Raises:
        ConfigError: ``compare`` is not one of :data:`COMPARES`.
    """
    if compare not in COMPARES:
        raise ConfigError(f"compare {compare!r} is not one of {COMPARES}")
    t = np.asarray(threshold, dtype=np.float32)
    if compare == ">=":
        return t
    return np.nextafter(t, np.float32(np.inf)).astype(np.float32)


def v_init_metadata(v_init: np.ndarray) -> float | list[float]:
    """``v_init`` (units of theta) as written: the number 0.5 for QCFS's shift, else a list."""
    v = np.asarray(v_init, dtype=np.float32)
    return 0.5 if v.ndim == 0 and float(v) == 0.5 else [float(x) for x in v.reshape(-1)]


def neuron_metadata(reset: str, v_init: Any, per_channel: bool, burst: int = 1) -> dict[str, Any]:
    """The metadata of one neuron site (see the module docstring); ``burst`` is written only
    where it is above 1."""
    if reset not in RESETS:
        raise ConfigError(f"reset {reset!r} is not one of {RESETS}")
    meta = {NEURON_KEY: "if", "reset": reset, "v_init": v_init, "compare": COMPARE,
            "threshold": "per_channel" if per_channel else "per_layer"}
    if burst != 1:
        meta[BURST_KEY] = int(burst)
    return meta


def graph_metadata(T: int, reset: str) -> dict[str, Any]:
    """The graph metadata of an snnconv file."""
    return {"producer": PRODUCER, "snnconv_format": FORMAT_VERSION, "T": int(T), "reset": reset,
            "encoding": "direct", "readout": "mean_over_T"}


def predates_v_reset(version: Any) -> bool | None:
    """Whether a file written by nir ``version`` (the file's ``version`` string) predates
    ``v_reset``, i.e. its ``IF`` resets by subtraction: ``True`` below 1.0.6, ``False`` from
    1.0.6 on, ``None`` for a version that is missing or not ``X.Y.Z``."""
    if isinstance(version, bytes):
        version = version.decode("utf8", "replace")
    if not isinstance(version, str):
        return None
    m = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups()) < V_RESET_SINCE


def legacy_if_reason(node: str, version: Any) -> str:
    """Why an ``IF`` node of a file written by nir ``version`` (before ``v_reset``) is refused."""
    return (f"node '{node}': the file was written by nir {version}, before IF had v_reset (nir "
            f"{'.'.join(map(str, V_RESET_SINCE))}); its IF resets by subtraction (v - v_threshold), "
            "which nir's reader turns into v_reset = 0 without a word. snnconv runs subtraction "
            "only in units of the threshold (the I/Threshold/Scale pattern), so it refuses this "
            "node rather than change its meaning. Re-export the network with nir >= 1.0.6 "
            "(stating v_reset)")


def integration_gain(r: np.ndarray, dt: float) -> np.ndarray:
    """The per-step gain ``r * dt`` of an integrator (forward Euler of ``dv/dt = r I`` at
    ``dt``), rounded to float32; snnconv's neurons run where it is exactly 1."""
    return (np.asarray(r, dtype=np.float64) * float(dt)).astype(np.float32)
