"""NIR's leaky neurons on Loihi 2: ``LIF`` and ``CubaLIF`` as Lava's own CUBA LIF neuron, ``LI``
as a leaky readout, with the decays ``du``, ``dv`` from ``dt / tau`` (:func:`leaky_spec`).

Lava's fixed-point LIF (``AbstractPyLifModelFixed``), per step::

    u = trunc(u * (4096 - (du + 1)) / 4096) + (a_in << 6)     (wraps at 24 bits)
    v = clip24(trunc(v * (4096 - dv) / 4096) + u + bias)
    s = v > vth << 6;  v = 0 where s

is NIR's forward-Euler step (:mod:`snnconv.snn.neuron`) in integer units ``v_int = S * v`` with
``S = (vth << 6) / v_threshold``, when::

    LIF:      du = 4095 (no current memory), dv = round(4096 * dt / tau),
              input gain g = dt/tau * r                  (u = S * g * x)
    CubaLIF:  du = round(4096 * dt / tau_syn) - 1, dv = round(4096 * dt / tau_mem),
              g = dt/tau_mem * r * dt/tau_syn * w_in     (u = S * dt/tau_mem * r * i)
    LI:       the readout, dv = round(4096 * dt / tau), g = dt/tau * r, never spiking

The gain is folded into the incoming weights (and the first layer's bias currents): for the
quantisation a leaky neuron is an IF neuron with threshold ``v_threshold / g``. The decays
are the only approximation beyond the weights' (``dt / tau`` rounded to 1/4096; the rounding
is in each population's report). What Lava's neuron does not have is refused: ``v_leak != 0``,
``v_reset != 0``, time constants that differ within a layer (``du``, ``dv`` are one value per
process), ``r``, ``w_in`` or ``v_threshold`` that vary within a channel (the weights of a
convolution are shared), non-positive ``r``, ``w_in`` or ``v_threshold``, and a CubaLIF fed
by the static first layer with ``tau_syn != dt`` (its input enters ``v`` as a bias, past the
current). The worst-case input is bounded so that neither the current of a CubaLIF nor the
membrane of an LI readout can wrap or reach the threshold: ``|u| <= 64 * a_in * 4096 / (du + 1)``
and ``|v| <= 64 * a_in * 4096 / dv`` (a geometric series; the truncating decay only shrinks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from snnconv.errors import BackendError
from snnconv_backends.loihi2.chip import LOIHI

__all__ = ["LeakySpec", "leaky_spec"]

_V_MAX = 2 ** (LOIHI["uv_bits"] - 1)
_LI_V_MAX = (LOIHI["vth_max"] << LOIHI["vth_shift"]) - 1  # below any threshold Lava's LIF can have


@dataclass(frozen=True)
class LeakySpec:
    """A leaky op on the chip: ``theta`` (``v_threshold / g`` per channel, ``[C]`` or ``[1]``;
    ones for LI), ``gain`` (``g``), the decays and the largest ``a_in`` the state can hold."""

    theta: np.ndarray
    gain: np.ndarray
    du: int
    dv: int
    a_in_max: int
    report: dict


def _per_channel(arr: Any, name: str, what: str, positive: bool = True) -> np.ndarray:
    """A full batch-free parameter as one value ``[1]`` or one per channel ``[C]`` (dim 0)."""
    a = np.asarray(arr, np.float64)
    flat = a.reshape(-1)
    if positive and (flat <= 0).any():
        raise BackendError(f"loihi2-sim: '{name}': {what} must be positive on Loihi; found "
                           f"min {float(flat.min())!r}")
    if (flat == flat[0]).all():
        return flat[:1].copy()
    per = a.reshape(a.shape[0], -1)
    if not (per == per[:, :1]).all():
        raise BackendError(f"loihi2-sim: '{name}': {what} varies within a channel; Loihi runs it per "
                           "layer or per channel (dim 0), as the shared weights of a convolution need")
    return per[:, 0].copy()


def _uniform(arr: Any, name: str, what: str) -> float:
    flat = np.asarray(arr, np.float64).reshape(-1)
    if not (flat == flat[0]).all():
        raise BackendError(f"loihi2-sim: '{name}': {what} differs within the layer (from "
                           f"{float(flat.min())!r} to {float(flat.max())!r}); Lava's LIF has one "
                           "du and dv per process: give the layer one time constant")
    return float(flat[0])


def _decay(k: float, name: str, what: str, offset: int) -> int:
    """``round(4096 * k) - offset`` within Lava's 12-bit decay (0..4095)."""
    d = int(round(4096 * k)) - offset
    if d + offset < 1:  # no decay at all: an integrator, not the leaky neuron of the graph
        raise BackendError(f"loihi2-sim: '{name}': {what} = {k!r} is below Loihi's decay "
                           "resolution 1/4096; give a larger dt or a smaller time constant")
    return min(d, 4095)


def leaky_spec(op: Any, static: bool, role: str) -> LeakySpec:
    """The chip mapping of leaky op ``op`` (``"lif"``, ``"cubalif"``; ``"li"`` as the readout).

    Raises:
        BackendError: what Lava's neuron cannot run (see the module docstring), named.
    """
    p, name = op.params, op.name
    if op.kind == "li" and role != "readout":
        raise BackendError(f"loihi2-sim: LI node '{name}' feeds other layers; on Loihi an LI runs "
                           "only as the readout (directly before the Output)")
    for what in ("v_leak", "v_reset"):
        if what in p and bool(np.any(np.asarray(p[what]) != 0)):
            raise BackendError(f"loihi2-sim: '{name}': {what} != 0; Lava's LIF neuron has no leak "
                               "potential and resets to 0")
    k_mem = _uniform(p["k_mem"], name, "dt / tau")
    dv = _decay(k_mem, name, "dt / tau", 0)
    gain = _per_channel(p["g_in"], name, "r")  # dt/tau * r
    du, a_max = 4095, LOIHI["a_in_max"]
    report = {"dt_over_tau": k_mem, "dv": dv, "decay_error_v": dv / 4096 - k_mem}
    if op.kind == "cubalif":
        k_syn = _uniform(p["k_syn"], name, "dt / tau_syn")
        du = _decay(k_syn, name, "dt / tau_syn", 1)
        if static and du != 4095:
            raise BackendError(f"loihi2-sim: CubaLIF '{name}' is fed by the static first layer, whose "
                               "input enters the membrane as a bias current, past the synaptic "
                               f"current; that is exact only with tau_syn = dt (here dt/tau_syn = {k_syn!r})")
        gain = gain * _per_channel(p["g_syn"], name, "w_in")  # dt/tau_syn * w_in
        # |u| <= 64 * a_in * 4096 / (du + 1) must not wrap (<= 2**23)
        a_max = min(a_max, _V_MAX * (du + 1) // (64 * 4096))
        report.update({"dt_over_tau_syn": k_syn, "du": du, "decay_error_u": (du + 1) / 4096 - k_syn})
    if op.kind == "li":
        # |v| <= 64 * a_in * 4096 / dv must stay below any threshold and within 24 bits
        a_max = min(a_max, _LI_V_MAX * dv // (64 * 4096))
        theta = np.ones(1)
    else:
        theta = _per_channel(p["v_threshold"], name, "v_threshold") / gain
    if a_max < 1:
        raise BackendError(f"loihi2-sim: '{name}': its decays leave no input budget (a_in <= {a_max})")
    report["a_in_max"] = a_max
    return LeakySpec(theta=theta, gain=gain, du=du, dv=dv, a_in_max=int(a_max), report=report)
