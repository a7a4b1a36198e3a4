"""NIR's leaky neurons (``LIF``, ``CubaLIF``, ``LI``) read into ops of the strict reader
(:func:`snnconv.nir.reader.parse`), discretised by forward Euler at the reading's ``dt``.

Op kinds and their ``params`` (float32 arrays of the node's batch-free shape, read-only; the
meaning of each step is :mod:`snnconv.snn.neuron`'s :func:`~snnconv.snn.neuron.lif_step`,
:func:`~snnconv.snn.neuron.cubalif_step` and :func:`~snnconv.snn.neuron.li_step`, from the zero
state)::

    lif      k_mem = dt/tau, g_in = dt/tau * r, v_leak, v_threshold, v_reset   (spikes on v > v_threshold)
    cubalif  k_mem = dt/tau_mem, g_in = dt/tau_mem * r, k_syn = dt/tau_syn, g_syn = dt/tau_syn * w_in,
             v_leak, v_threshold, v_reset
    li       k_mem = dt/tau, g_in = dt/tau * r, v_leak                         (outputs its membrane)

Each coefficient is computed in float64 and rounded once to float32 (a file written with
``r = tau / dt``, as snntorch and norse write them, has ``g_in = 1`` exactly); a ``dt / tau``
above 1 (``dt``
larger than a time constant, where the Euler decay factor ``1 - dt / tau`` turns negative)
is refused, as are non-positive time constants and NaN/inf values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from snnconv.errors import NIRError
from snnconv.snn.neuron import LEAKY_KINDS, LeakyParams

__all__ = ["LEAKY_KINDS", "SPIKING", "STATEFUL", "read_leaky", "check_dt", "leaky_params"]

#: Op kinds whose outputs are spikes (the IF ``neuron`` and the spiking leaky kinds).
SPIKING = ("neuron", "lif", "cubalif")
#: Op kinds with a state carried from step to step.
STATEFUL = SPIKING + ("li",)

# kind -> (NIR fields read, time constants among them)
_FIELDS = {
    "lif": (("tau", "r", "v_leak", "v_threshold", "v_reset"), ("tau",)),
    "cubalif": (("tau_mem", "tau_syn", "r", "v_leak", "v_threshold", "v_reset", "w_in"),
                ("tau_mem", "tau_syn")),
    "li": (("tau", "r", "v_leak"), ("tau",)),
}


def check_dt(dt: Any) -> float:
    """``dt`` as a positive finite float (NIRError otherwise)."""
    if isinstance(dt, bool) or not isinstance(dt, (int, float, np.integer, np.floating)) \
            or not np.isfinite(dt) or dt <= 0:
        raise NIRError(f"dt must be a positive finite number (the time step of reading), got {dt!r}")
    return float(dt)


def _field(name: str, node: Any, field: str) -> np.ndarray:
    value = getattr(node, field, None)
    if value is None and field == "v_reset":  # nir < 1.0.6 had none; nir's reader fills in 0
        value = np.zeros_like(np.asarray(node.v_threshold, dtype=np.float64))
    if value is None:
        raise NIRError(f"node '{name}': {type(node).__name__} lacks {field}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise NIRError(f"node '{name}': {field} is not an array of numbers ({exc})") from None
    if not np.isfinite(arr).all():
        raise NIRError(f"node '{name}': {field} holds {int((~np.isfinite(arr)).sum())} NaN/inf value(s)")
    return arr


def read_leaky(name: str, node: Any, kind: str, dt: float) -> tuple[str, dict[str, np.ndarray],
                                                                   tuple[int, ...], tuple[int, ...]]:
    """``(kind, params, in_shape, out_shape)`` of a ``LIF``, ``CubaLIF`` or ``LI`` node read at
    time step ``dt``."""
    dt = check_dt(dt)
    fields, taus = _FIELDS[kind]
    raw = {f: _field(name, node, f) for f in fields}
    shape = raw[fields[0]].shape
    if not shape:
        raise NIRError(f"node '{name}': {type(node).__name__} parameters are scalars; NIR gives them "
                       "the neuron's batch-free shape")
    for f, arr in raw.items():
        if f == "w_in" and arr.ndim == 0:
            raw[f] = np.broadcast_to(arr, shape)
        elif arr.shape != shape:
            raise NIRError(f"node '{name}': {type(node).__name__} parameter shapes disagree: "
                           f"{fields[0]} {shape}, {f} {arr.shape}")
    params: dict[str, np.ndarray] = {}
    for tau in taus:
        t = raw[tau]
        if (t <= 0).any():
            raise NIRError(f"node '{name}': {tau} must be positive; found min {float(t.min())!r}")
        k = dt / t
        if (k > 1).any():
            raise NIRError(f"node '{name}': dt / {tau} = {float(k.max())!r} > 1 (dt = {dt!r}, {tau} "
                           f"min {float(t.min())!r}); forward Euler's decay 1 - dt/{tau} would be "
                           "negative. Read the graph with the dt its producer used (e.g. dt=1e-4 "
                           "for snntorch and norse exports)")
        if tau == "tau_syn":
            params["k_syn"], params["g_syn"] = k, k * raw["w_in"]
        else:
            params["k_mem"], params["g_in"] = k, k * raw["r"]
    params.update({f: raw[f] for f in fields if f not in taus + ("r", "w_in")})
    out = {}
    for field_name, v in params.items():
        a = np.ascontiguousarray(v, dtype=np.float32)
        a.setflags(write=False)
        out[field_name] = a
    return kind, out, shape, shape


def leaky_params(params: Any) -> LeakyParams:
    """An op's params as :class:`snnconv.snn.neuron.LeakyParams` (float32 CPU tensors)."""
    return LeakyParams(**{k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in params.items()})
