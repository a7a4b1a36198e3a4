"""The neurons: the integrate-and-fire neuron, NIR's leaky neurons (LIF, CubaLIF, LI), their
step functions and torch modules, and the small modules that carry values between neurons.

Semantics (pinned here, in :func:`if_step`; every torch path of :class:`IFNeuron` gives its
spikes bit for bit, tested)::

    h[t] = v[t-1] + x[t]
    s[t] = 1 if h[t] >= theta else 0    (spikingjelly's Heaviside: fires on equality)
    v[t] = h[t] - theta * s[t]          (reset="subtract")
    v[t] = (1 - s[t]) * h[t]            (reset="zero", hard reset)

A burst neuron (``burst = B > 1``, reset by subtraction only) may emit up to B spikes in one
step, a graded spike (Loihi 2 carries it as one message)::

    s[t] = min(B, floor(h[t] / theta))  for h[t] >= theta, else 0     (B = 1: the step above)
    v[t] = h[t] - theta * s[t]

Its rate over T steps has T * B levels between 0 and B * theta: with theta = lambda / B it is
QCFS at L = T * B in T steps (:func:`snnconv.stages.spiking.to_spiking`).

:class:`IFNeuron` keeps a subtractive-reset membrane in units of theta (its input divided by
theta, threshold 1) and starts it at ``v_init`` (1/2, i.e. theta / 2, unless calibrated; per
channel after membrane calibration, see :func:`snnconv.calibration.calibrate_bias`); a
hard-reset membrane is kept in input units and starts at 0.

Leaky neurons (:func:`lif_step`, :func:`cubalif_step`, :func:`li_step`, :class:`LeakyNeuron`)
mean what NIR 1.0.8's ``LIF``, ``CubaLIF`` and ``LI`` nodes say, discretised by forward Euler
at the reading's ``dt`` and started from the zero state; per step, in this order::

    i[t] = i[t-1] + dt/tau_syn * (w_in * x[t] - i[t-1])              (CubaLIF: current first)
    h[t] = v[t-1] + dt/tau * ((v_leak - v[t-1]) + r * x[t])          (CubaLIF: r * i[t])
    s[t] = 1 if h[t] > v_threshold else 0                             (NIR's strict comparison)
    v[t] = v_reset if s[t] else h[t]                                  (LI: v[t] = h[t], no spike)

computed as ``h = v + k_mem * (v_leak - v) + g_in * x`` and ``i' = i - k_syn * i + g_syn * x``
with the input gains ``g_in = dt/tau * r`` and ``g_syn = dt/tau_syn * w_in`` multiplied once in
float64 (:class:`LeakyParams`): a file written with ``r = tau/dt`` (snntorch, norse) has a gain
of exactly 1.

This module imports no conversion stage at import time, so that executors outside the
converter (``snnconv_backends``) may use the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
from spikingjelly.activation_based import neuron, surrogate

from snnconv.errors import ConfigError
from snnconv.vocabulary import MAX_BURST, RESETS

__all__ = ["RESETS", "MAX_BURST", "emit", "if_step", "if_sequence", "fire_subtractive_", "fire_zero", "channel_view",
           "check_burst", "IFNeuron", "Scale", "TimeExpand", "neurons", "LEAKY_KINDS", "LeakyParams", "lif_step",
           "cubalif_step", "li_step", "leaky_sequence", "LeakyNeuron"]


def check_burst(burst: object, reset: str = "subtract") -> int:
    """``burst`` as an int in ``[1, MAX_BURST]``; a burst neuron resets by subtraction."""
    if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_BURST:
        raise ConfigError(f"burst (spikes a neuron may emit in one step) must be an integer in [1, "
                          f"{MAX_BURST}], got {burst!r}")
    if burst > 1 and reset != "subtract":
        raise ConfigError(f"a burst neuron (burst={burst}) resets by subtraction: reset='zero' "
                          "would drop the charge beyond one threshold. Use burst=1 with reset='zero'")
    return int(burst)


def emit(h: torch.Tensor, burst: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """The spikes of a membrane ``h`` in units of theta: ``h >= 1`` (0 or 1), or with ``burst``
    B > 1 ``min(B, floor(h))`` where ``h >= 1``, else 0 (``out``: written in place)."""
    if burst == 1:
        return torch.ge(h, 1.0, out=out) if out is not None else (h >= 1.0).to(h.dtype)
    if out is None:
        return torch.floor(h).clamp_(0, burst)
    return torch.floor(h, out=out).clamp_(0, burst)


def if_step(v: torch.Tensor, x: torch.Tensor, theta: float | torch.Tensor, *, reset: str = "subtract",
            surrogate_function: Callable[[torch.Tensor], torch.Tensor] | None = None,
            detach_reset: bool = False, burst: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One IF step: the spikes and the next membrane from membrane ``v`` and input ``x``.

    .. math::
        h = v + x, \\quad s = [h \\ge \\theta], \\quad
        v' = h - \\theta s \\ (\\text{subtract}) \\quad\\text{or}\\quad v' = (1 - s) h \\ (\\text{zero})

    Args:
        v: the membrane before the step (broadcasts against ``x``).
        x: the input of this step.
        theta: the threshold (a number, or a tensor that broadcasts against ``x``).
        reset: ``"subtract"`` or ``"zero"``.
        surrogate_function: ``None`` (no gradient through the spike), or a spikingjelly
            surrogate applied to ``h - theta`` (Heaviside forward: ``h - theta >= 0`` is
            ``h >= theta`` in IEEE arithmetic).
        detach_reset: no gradient through the spike in the reset.
        burst: up to this many spikes in one step (subtractive reset): ``s`` is the sum over
            k = 1..B of ``h >= k * theta`` (with a surrogate, of ``surrogate(h - k * theta)``).

    Returns:
        ``(s, v')``: spikes in {0, 1} (in {0, ..., B} for a burst) of ``h``'s dtype and the
        membrane after the reset.

    Raises:
        ValueError: an unknown ``reset``.

    Shape:
        ``x``: any; ``s`` and ``v'``: the broadcast shape of ``v`` and ``x``.
    """
    if reset not in RESETS:
        raise ConfigError(f"IF reset must be one of {RESETS}, got {reset!r}")
    h = v + x
    if burst > 1:
        check_burst(burst, reset)
        fire = (lambda k: (h >= k * theta).to(h.dtype)) if surrogate_function is None else (
            lambda k: surrogate_function(h - k * theta))
        s = fire(1)
        for k in range(2, burst + 1):
            s = s + fire(k)
    else:
        s = (h >= theta).to(h.dtype) if surrogate_function is None else surrogate_function(h - theta)
    kept = s.detach() if detach_reset else s
    if reset == "subtract":
        return s, h - theta * kept
    return s, (1.0 - kept) * h


def if_sequence(seq: torch.Tensor, v: torch.Tensor, theta: float | torch.Tensor, **step) -> torch.Tensor:
    """The spikes ``[T, ...]`` of :func:`if_step` over ``seq[0], ..., seq[T-1]`` from membrane
    ``v`` (``step``: :func:`if_step`'s keywords)."""
    spikes = []
    for x in seq:
        s, v = if_step(v, x, theta, **step)
        spikes.append(s)
    return torch.stack(spikes)


def fire_subtractive_(u: torch.Tensor, v0: torch.Tensor,
                      thresholds: torch.Tensor | None = None, burst: int = 1) -> torch.Tensor:
    """:func:`if_sequence` of a subtractive-reset neuron with threshold 1 on ``u`` (``[T, b,
    ...]``, the input in units of theta) from membrane ``v0``, in place: the spikes overwrite
    ``u``, three tensor operations per step and no autograd. With ``thresholds`` (``[T, ...]``),
    step ``t`` compares with ``thresholds[t]`` instead of 1 (a burst: the membrane is raised by
    ``1 - thresholds[t]`` before :func:`emit`). Returns the membrane after the last step (a new
    tensor).

    Bit for bit the step's spikes (tested): ``v0 + u[0]`` is ``u[0] + v0``; ``h - 1 * s`` is
    ``h - s``."""
    v = u[0] + v0
    for t in range(u.shape[0]):
        if t:
            v.add_(u[t])
        if burst == 1:
            torch.ge(v, 1.0 if thresholds is None else thresholds[t], out=u[t])
        elif thresholds is None:
            emit(v, burst, out=u[t])
        else:
            emit(v - thresholds[t] + 1.0, burst, out=u[t])
        v.sub_(u[t])
    return v


def fire_zero(seq: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """:func:`if_sequence` of a hard-reset neuron from ``v = 0`` on ``seq`` (``[T, b, ...]``),
    in place on one membrane, no autograd: the spikes ``[T, b, ...]``.

    The step's spikes bit for bit (tested): ``h - h * s`` is ``(1 - s) * h`` for ``s`` in {0, 1}
    but for the sign of a zero membrane, which no comparison with ``theta > 0`` sees."""
    s = torch.empty_like(seq)
    v = seq[0].clone()
    for t in range(seq.shape[0]):
        if t:
            v.add_(seq[t])
        torch.ge(v, theta, out=s[t])
        v.addcmul_(v, s[t], value=-1.0)
    return s


def channel_view(theta: torch.Tensor, ndim: int, channel_dim: int = 1) -> torch.Tensor:
    """``theta`` (``[]`` or ``[C]``) shaped to broadcast over ``ndim`` dimensions, channels on
    ``channel_dim``."""
    if theta.dim() == 0:
        return theta
    shape = [1] * ndim
    shape[channel_dim] = -1
    return theta.reshape(shape)


class IFNeuron(nn.Module):
    """Multi-step IF neuron with threshold ``theta``: reset by subtraction (default) or to zero.

    ``reset="subtract"``: with gradients, spikingjelly's :class:`HalfThresholdIFNode`
    (threshold 1) on the input divided by ``theta`` (``v[0] = theta / 2``; see the module
    docstring). ``reset="zero"`` (hard reset, spikingjelly's ``IFNode(v_threshold=theta,
    v_reset=0.)``, forward bit for bit): :func:`if_step` from ``v[0] = 0``. Without gradients,
    the in-place kernels :func:`fire_subtractive_` and :func:`fire_zero`. ``burst`` B > 1: up to
    B spikes in one step (subtractive reset; see the module docstring), with gradients the sum
    of B surrogates at theta, 2 theta, ..., B theta.

    theta may be per layer (shape ``[]``) or per channel (``[C]``, dim 1) and trainable; both
    modes use the ATan surrogate gradient. The state is reset at every call, so a call is a
    pure function of its input. ``v_init`` (subtractive reset only; a buffer, never trained)
    is the initial membrane in units of theta, per layer or per channel: 1/2 (QCFS's shift)
    unless :func:`snnconv.calibration.calibrate_bias` calibrated it.

    Shape:
        input ``[T*B, C, ...]`` (time-major), output: same, values in {0, 1}.
    """

    theta: nn.Parameter
    v_init: torch.Tensor

    def __init__(self, theta: float | torch.Tensor, T: int = 8, *, alpha: float = 2.0,
                 detach_reset: bool = False, reset: str = "subtract",
                 v_init: float | torch.Tensor | None = None, burst: int = 1):
        super().__init__()
        theta = torch.as_tensor(theta, dtype=torch.float32).detach().clone()
        if theta.dim() > 1 or (theta <= 0).any() or not torch.isfinite(theta).all():
            raise ConfigError(f"IF threshold must be positive and finite, shape [] or [C]; got {theta}")
        if reset not in RESETS:
            raise ConfigError(f"IF reset must be one of {RESETS}, got {reset!r}")
        default = 0.5 if reset == "subtract" else 0.0
        v_init = torch.as_tensor(default if v_init is None else v_init, dtype=torch.float32).detach().clone()
        if v_init.dim() > 1 or not torch.isfinite(v_init).all():
            raise ConfigError(f"IF v_init must be finite, shape [] or [C]; got {v_init}")
        if reset == "zero" and bool((v_init != 0).any()):
            raise ConfigError("a hard-reset IF neuron starts at v = 0 (NIR's IF has no initial "
                             "membrane); v_init applies to reset='subtract' only")
        self.burst = check_burst(burst, reset)
        self.register_buffer("v_init", v_init)
        self.theta = nn.Parameter(theta, requires_grad=False)
        self.T = int(T)
        self.alpha = float(alpha)
        self.detach_reset = bool(detach_reset)
        self.reset = reset
        self.node = neuron.HalfThresholdIFNode(
            v_threshold=1.0, surrogate_function=surrogate.ATan(alpha=self.alpha),
            detach_reset=self.detach_reset, step_mode="m")
        self.rate_levels = 0  # > 0: compute the rate limit instead (see SpikingNetwork.rate)

    def set_surrogate(self, alpha: float | None = None, detach_reset: bool | None = None) -> None:
        """Change the surrogate sharpness or ``detach_reset`` (used by fine-tuning)."""
        if alpha is not None:
            self.alpha = float(alpha)
            self.node.surrogate_function = surrogate.ATan(alpha=self.alpha)
        if detach_reset is not None:
            self.detach_reset = bool(detach_reset)
            self.node.detach_reset = self.detach_reset

    def _inference(self, seq: torch.Tensor) -> torch.Tensor:
        """The dynamics without autograd, in place (see :func:`fire_subtractive_`,
        :func:`fire_zero`)."""
        if self.reset == "zero":
            return fire_zero(seq, channel_view(self.theta, seq.dim() - 1))
        # ours: the input in units of theta, its steps become spikes
        u = seq / channel_view(self.theta, seq.dim(), channel_dim=2)
        fire_subtractive_(u, channel_view(self.v_init.to(u.dtype), u.dim() - 1), burst=self.burst)
        return u

    def _rate(self, x: torch.Tensor) -> torch.Tensor:
        if self.reset != "subtract":
            raise ConfigError("SpikingNetwork.rate() is the QCFS limit of subtractive-reset "
                             "neurons; this network resets to zero")
        from snnconv.activation import FloorSTE  # QCFS's floor; imported here, so the step stays stage-free

        # the spike count of T = L steps on a constant input, divided by L: QCFS(L, theta)/theta
        L = self.rate_levels
        q = FloorSTE.apply(x / channel_view(self.theta, x.dim()) * L + 0.5)
        return torch.clamp(q, 0, L * self.burst) / L

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate_levels:
            return self._rate(x)
        TB = x.shape[0]
        if TB % self.T:
            raise ConfigError(f"IFNeuron got a batch of {TB}, not a multiple of T={self.T}")
        seq = x.reshape(self.T, TB // self.T, *x.shape[1:])
        if not torch.is_grad_enabled():
            return self._inference(seq).reshape(x.shape)
        if self.reset == "zero":
            return if_sequence(seq, torch.zeros_like(seq[0]), channel_view(self.theta, seq.dim() - 1),
                               reset="zero", surrogate_function=self.node.surrogate_function,
                               detach_reset=self.detach_reset).reshape(x.shape)
        theta = channel_view(self.theta, seq.dim(), channel_dim=2)
        if self.burst > 1:  # in units of theta, from v_init: the step of if_step with its sum of surrogates
            v0 = channel_view(self.v_init.to(seq.dtype), seq.dim() - 1).expand(seq.shape[1:])
            return if_sequence(seq / theta, v0, 1.0, surrogate_function=self.node.surrogate_function,
                               detach_reset=self.detach_reset, burst=self.burst).reshape(x.shape)
        self.node.reset()
        if self.v_init.dim() or float(self.v_init) != 0.5:
            # the initial membrane as a full tensor (spikingjelly uses one of x[0]'s shape)
            v0 = channel_view(self.v_init.to(seq.dtype), seq.dim() - 1)
            self.node.v = v0.expand(seq.shape[1:]).clone()
        spikes = self.node(seq / theta)
        self.node.reset()
        return spikes.reshape(x.shape)

    def extra_repr(self) -> str:
        kind = "per-layer" if self.theta.dim() == 0 else f"per-channel[{self.theta.numel()}]"
        v0 = "" if self.v_init.dim() == 0 else f", v_init=per-channel[{self.v_init.numel()}]"
        burst = f", burst={self.burst}" if self.burst > 1 else ""
        return (f"theta={kind}, T={self.T}, reset={self.reset}, alpha={self.alpha}, "
                f"detach_reset={self.detach_reset}{v0}{burst}")


class Scale(nn.Module):
    """Multiply by ``theta``: per layer, per channel on dim 1 (a spike train back to values), or
    per position (a batch-free map of two or more dims that broadcasts against the input, such
    as the divisors of a ceil-mode pooling, :mod:`snnconv.constructs.pools`)."""

    theta: nn.Parameter

    def __init__(self, theta: float | torch.Tensor):
        super().__init__()
        self.theta = nn.Parameter(torch.as_tensor(theta, dtype=torch.float32).detach().clone(),
                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.theta if self.theta.dim() > 1 else channel_view(self.theta, x.dim()))


class TimeExpand(nn.Module):
    """``[B, ...] -> [T*B, ...]``: the static input presented at each of T steps."""

    def __init__(self, T: int = 8):
        super().__init__()
        self.T = int(T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(self.T, *x.shape).reshape(self.T * x.shape[0], *x.shape[1:])


def neurons(model: nn.Module) -> dict[str, IFNeuron]:
    """The IF neurons of ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, IFNeuron)}


# --- leaky neurons: NIR's LIF, CubaLIF and LI -------------------------------------------------

#: The leaky node kinds (NIR's ``LIF``, ``CubaLIF``, ``LI``); the first two spike.
LEAKY_KINDS = ("lif", "cubalif", "li")


@dataclass(frozen=True)
class LeakyParams:
    """The discrete-time coefficients of a leaky neuron (forward Euler at ``dt``).

    Every field broadcasts against the neuron's input ``[b, *shape]`` (the executors keep the
    node's full batch-free shape). ``k_mem = dt / tau_mem`` (``tau`` for LIF and LI), the
    membrane's input gain ``g_in = k_mem * r``; CubaLIF only: ``k_syn = dt / tau_syn`` and the
    current's input gain ``g_syn = k_syn * w_in``. ``v_threshold`` and ``v_reset`` are ``None``
    for LI.
    """

    k_mem: torch.Tensor
    g_in: torch.Tensor
    v_leak: torch.Tensor
    v_threshold: torch.Tensor | None = None
    v_reset: torch.Tensor | None = None
    k_syn: torch.Tensor | None = None
    g_syn: torch.Tensor | None = None

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "LeakyParams":
        """The same coefficients as tensors of ``dtype`` on ``device``."""
        return LeakyParams(**{k: None if v is None else torch.as_tensor(v).to(device=device, dtype=dtype)  # type: ignore[arg-type]
                              for k, v in vars(self).items()})


def _fire(h: torch.Tensor, p: LeakyParams, surrogate_function, detach_reset: bool):
    """NIR's spike and reset: ``s = [h > v_threshold]``, ``v' = v_reset`` where ``s`` (a
    spikingjelly surrogate fires on ``>=``; the tie is taken off its forward value, which keeps
    its gradient)."""
    assert p.v_threshold is not None and p.v_reset is not None, "a spiking neuron has a threshold and a reset"
    x = h - p.v_threshold
    if surrogate_function is None:
        s = (x > 0).to(h.dtype)
    else:
        s = surrogate_function(x) - (x == 0).to(h.dtype)
    kept = s.detach() if detach_reset else s
    return s, (1.0 - kept) * h + kept * p.v_reset


def lif_step(v: torch.Tensor, x: torch.Tensor, p: LeakyParams, *,
             surrogate_function: Callable[[torch.Tensor], torch.Tensor] | None = None,
             detach_reset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of NIR's ``LIF``, ``tau dv/dt = (v_leak - v) + r I``, forward Euler at ``dt``.

    .. math::
        h = v + k_{mem} (v_{leak} - v) + g_{in} x, \\quad s = [h > v_{threshold}], \\quad
        v' = (1 - s) h + s \\, v_{reset}

    with ``k_mem = dt / tau`` and ``g_in = dt / tau * r``: forward Euler of
    ``tau dv/dt = (v_leak - v) + r x``.

    Args:
        v: the membrane after the previous step (0 before the first).
        x: the input of this step.
        p: the coefficients.
        surrogate_function: ``None`` (no gradient through the spike), or a spikingjelly
            surrogate applied to ``h - v_threshold`` (forward: NIR's strict ``>``).
        detach_reset: no gradient through the spike in the reset.

    Returns:
        ``(s, v')``: spikes in {0, 1} of ``h``'s dtype and the membrane after the reset.

    Shape:
        ``x``: ``[b, *shape]``; ``s`` and ``v'``: the same.
    """
    h = v + p.k_mem * (p.v_leak - v) + p.g_in * x
    return _fire(h, p, surrogate_function, detach_reset)


def cubalif_step(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, p: LeakyParams, *,
                 surrogate_function: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 detach_reset: bool = False):
    """One step of NIR's ``CubaLIF``: the synaptic current first, then the membrane from the
    new current, then the spike and the reset (Loihi's and Lava's order).

    .. math::
        i' = i - k_{syn} i + g_{syn} x, \\quad h = v + k_{mem} (v_{leak} - v) + g_{in} i', \\quad
        s = [h > v_{threshold}], \\quad v' = (1 - s) h + s \\, v_{reset}

    with ``g_syn = dt/tau_syn * w_in`` and ``g_in = dt/tau_mem * r``: forward Euler of
    ``tau_syn di/dt = w_in x - i`` and ``tau_mem dv/dt = (v_leak - v) + r i``.

    Args:
        state: ``(i, v)`` after the previous step (both 0 before the first).
        x: the input of this step.
        p: the coefficients.
        surrogate_function, detach_reset: as :func:`lif_step`.

    Returns:
        ``(s, (i', v'))``.
    """
    i, v = state
    assert p.k_syn is not None and p.g_syn is not None, "CubaLIF has a synaptic current"
    i = i - p.k_syn * i + p.g_syn * x
    h = v + p.k_mem * (p.v_leak - v) + p.g_in * i
    s, v = _fire(h, p, surrogate_function, detach_reset)
    return s, (i, v)


def li_step(v: torch.Tensor, x: torch.Tensor, p: LeakyParams) -> torch.Tensor:
    """One step of NIR's ``LI`` (a non-spiking leaky readout): its output is the membrane.

    .. math::
        v' = v + k_{mem} (v_{leak} - v) + g_{in} x
    """
    return v + p.k_mem * (p.v_leak - v) + p.g_in * x


def leaky_sequence(kind: str, seq: Sequence[torch.Tensor] | torch.Tensor, p: LeakyParams, **step) -> torch.Tensor:
    """The outputs ``[T, b, *shape]`` of a leaky neuron over ``seq[0], ..., seq[T-1]`` from the
    zero state (``v = 0``, ``i = 0``: NIR defines no initial state; Lava's and snntorch's
    neurons start there): spikes for ``"lif"`` and ``"cubalif"``, the membrane for ``"li"``.
    ``step``: :func:`lif_step`'s keywords (spiking kinds only).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in LEAKY_KINDS:
        raise ConfigError(f"leaky neuron kind must be one of {LEAKY_KINDS}, got {kind!r}")
    zero = torch.zeros_like(seq[0] * p.k_mem)  # the broadcast shape of input and coefficients
    v, i = zero, zero
    out = []
    for x in seq:
        if kind == "li":
            v = li_step(v, x, p)
            out.append(v)
        elif kind == "lif":
            s, v = lif_step(v, x, p, **step)
            out.append(s)
        else:
            s, (i, v) = cubalif_step((i, v), x, p, **step)
            out.append(s)
    return torch.stack(out)


class LeakyNeuron(nn.Module):
    """Multi-step NIR ``LIF``, ``CubaLIF`` or ``LI`` (forward Euler at ``dt``), trainable by
    BPTT: :func:`leaky_sequence` with the ATan surrogate (forward: NIR's ``v > v_threshold``).

    The coefficients (:class:`LeakyParams`) are buffers, never trained; gradients flow to the
    layers around the neuron. The state starts at zero at every call, so a call is a pure
    function of its input.

    Args:
        kind: ``"lif"``, ``"cubalif"`` or ``"li"``.
        params: the coefficients (float32, the node's batch-free shape).
        T: time steps per call.
        alpha: the surrogate's sharpness; detach_reset: as :class:`IFNeuron`.

    Shape:
        input ``[T*B, *shape]`` (time-major), output: same (spikes in {0, 1}; LI: membranes).
    """

    def __init__(self, kind: str, params: LeakyParams, T: int = 8, *, alpha: float = 2.0,
                 detach_reset: bool = False):
        super().__init__()
        if kind not in LEAKY_KINDS:
            raise ConfigError(f"leaky neuron kind must be one of {LEAKY_KINDS}, got {kind!r}")
        self.kind = kind
        self.T = int(T)
        self.alpha = float(alpha)
        self.detach_reset = bool(detach_reset)
        self.surrogate_function = surrogate.ATan(alpha=self.alpha)
        self._fields = tuple(k for k, v in vars(params).items() if v is not None)
        for k in self._fields:
            self.register_buffer(k, torch.as_tensor(getattr(params, k), dtype=torch.float32).detach().clone())

    @property
    def params(self) -> LeakyParams:
        """The coefficients, as the step functions take them."""
        return LeakyParams(**{k: getattr(self, k) for k in self._fields})

    def set_surrogate(self, alpha: float | None = None, detach_reset: bool | None = None) -> None:
        """Change the surrogate sharpness or ``detach_reset``."""
        if alpha is not None:
            self.alpha = float(alpha)
            self.surrogate_function = surrogate.ATan(alpha=self.alpha)
        if detach_reset is not None:
            self.detach_reset = bool(detach_reset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TB = x.shape[0]
        if TB % self.T:
            raise ValueError(f"LeakyNeuron got a batch of {TB}, not a multiple of T={self.T}")
        seq = x.reshape(self.T, TB // self.T, *x.shape[1:])
        p = self.params.to(x.dtype, x.device)
        step = {} if self.kind == "li" else {
            "surrogate_function": self.surrogate_function if torch.is_grad_enabled() else None,
            "detach_reset": self.detach_reset}
        return leaky_sequence(self.kind, seq, p, **step).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, T={self.T}, alpha={self.alpha}, detach_reset={self.detach_reset}"
