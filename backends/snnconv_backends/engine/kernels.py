"""The IF neuron update of the dense executor: the exact in-place loop, and the same operations
unrolled and fused by ``torch.compile`` (same order: same bits)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from snnconv.errors import BackendError
from snnconv.snn.neuron import emit

if TYPE_CHECKING:
    from snnconv_backends.engine.stats import Stats

__all__ = ["if_loop", "compiled_loop"]


def if_loop(u: torch.Tensor, theta: torch.Tensor, T: int, static: bool, reset: str,
            ties: tuple[float, "Stats"] | None = None, v0: torch.Tensor | None = None, burst: int = 1,
            v_start: torch.Tensor | None = None, v_end: list | None = None):
    """Exact IF dynamics, in place. ``u``: ``[T, b, ...]`` (ours to overwrite) or, ``static``,
    ``[b, ...]`` presented at every step. Returns spikes ``[T, b, ...]`` in ``u.dtype`` and
    ``None`` (the statistics are taken from the spikes). ``ties = (tol, stats)``: also count
    the updates with ``|h - threshold| <= tol * threshold`` into ``stats``. ``v0``: the
    subtractive neuron's initial membrane (broadcastable, units of theta; None: 1/2). ``burst``
    B > 1: the subtractive neuron emits up to B spikes a step (:func:`snnconv.snn.neuron.emit`).
    ``v_start``: the membrane ``[b, ...]`` a run stopped with (a run continued step by step:
    the same operations as one run of all the steps); ``v_end``: a list that receives the
    membrane after the last step."""
    if static:
        x = u / theta if reset == "subtract" else u
        s = torch.empty((T, *u.shape), dtype=u.dtype, device=u.device)
        xs: list[torch.Tensor] | torch.Tensor = [x] * T
    else:
        s = u  # step t's spikes overwrite step t's input once it has been added
        xs = u
    v: torch.Tensor
    if reset == "subtract":
        half = (v_start if v_start is not None else
                torch.tensor(0.5, dtype=s.dtype, device=s.device) if v0 is None else v0)
        for t in range(T):
            # v[0] = 1/2 added in the first step's operation (a + b == b + a), no fill pass
            if static:
                v = torch.add(xs[0], half) if t == 0 else v.add_(xs[t])  # noqa: F821 (v is bound at t == 0)
            else:  # v + x / theta, the division rounded first (as SpikingNetwork's x / theta)
                v = torch.addcdiv(half, xs[0], theta) if t == 0 else v.addcdiv_(xs[t], theta)
            if ties is not None:
                level = 1.0 if burst == 1 else torch.round(v).clamp_(1, burst)  # the nearest k
                ties[1].add_ties(((v - level).abs() <= ties[0]).sum())
            emit(v, burst, out=s[t])
            v.sub_(s[t])
    else:
        for t in range(T):
            if t == 0:  # 0 + x[0] == x[0]
                v = xs[0].clone() if v_start is None else torch.add(v_start, xs[0])
            else:
                v.add_(xs[t])
            if ties is not None:
                ties[1].add_ties(((v - theta).abs() <= ties[0] * theta).sum())
            torch.ge(v, theta, out=s[t])
            v.addcmul_(v, s[t], value=-1.0)
    if v_end is not None:
        v_end.append(v)
    return s, None


def _if_fused(T: int, static: bool, reset: str, calibrated: bool = False, burst: int = 1) -> Callable:
    """The IF dynamics of :func:`if_loop` unrolled over ``T`` steps, written out of place so
    that ``torch.compile`` fuses them into one kernel (one read of the input, one write of the
    spikes, the membrane in registers), with the batch sum of the spikes per step and position
    (the statistics) in the same pass. Same operations in the same order: same bits. Only
    additions, subtractions, comparisons and products by 0/1 are fused (exact in any kernel);
    the division by theta stays outside (Triton's fp32 ``/`` may be approximate)."""

    def fused(x: torch.Tensor, theta: torch.Tensor, v0: torch.Tensor | None = None):
        v = (torch.full_like(x if static else x[0], 0.5 if reset == "subtract" else 0.0)
             if v0 is None else v0 + torch.zeros_like(x if static else x[0]))
        out = []
        for t in range(T):
            h = v + (x if static else x[t])
            if burst > 1:  # emit(h, burst), out of place
                s = torch.floor(h).clamp(0, burst)
            else:
                s = (h >= (1.0 if reset == "subtract" else theta)).to(x.dtype)
            v = h - s if reset == "subtract" else h - h * s
            out.append(s)
        s = torch.stack(out)
        per_pos = s.reshape(T, s.shape[1], -1).sum(1)
        return s, per_pos

    # dynamo keeps compiled variants per code object (and caps their number): give each
    # (T, static, reset) its own code object so that they do not evict one another
    tag = (f"if_fused_T{T}_{'static' if static else 'seq'}_{reset}{'_v0' if calibrated else ''}"
           f"{f'_burst{burst}' if burst > 1 else ''}")
    fused.__code__ = fused.__code__.replace(co_name=tag)
    fused.__name__ = fused.__qualname__ = tag
    return fused


_COMPILED: dict[tuple, Callable] = {}


def compiled_loop(u: torch.Tensor, theta: torch.Tensor, T: int, static: bool, reset: str,
                  v0: torch.Tensor | None = None, burst: int = 1):
    """:func:`_if_fused` through ``torch.compile``, cached for the process.

    The input is viewed as ``[T, b, C, M]`` (``[b, C, M]`` when static) and theta as ``[C, 1]``
    or ``[1, 1]``, so that one compiled kernel (shapes dynamic) serves every layer of a kind;
    the views change no value. Should dynamo give up on a shape, it runs the same function
    eagerly: slower, same bits.
    """
    lead = 1 if static else 2
    shape = u.shape
    C = max(theta.numel(), 1 if v0 is None else v0.numel())
    rest = shape[lead:]
    if C == 1:
        M = math.prod(rest)
        th = theta.reshape(1, 1)
        view = (*shape[:lead], 1, M)
    else:
        M = math.prod(rest[1:])
        th = theta.reshape(-1, 1).expand(C, 1)
        view = (*shape[:lead], C, M)
    if reset == "subtract":  # IEEE division by torch, as SpikingNetwork's x / theta
        u = u / theta if static else u.div_(theta)
    key = (T, static, reset, C == 1, M == 1, u.device.type, v0 is not None, burst)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = torch.compile(_if_fused(T, static, reset, v0 is not None, burst), dynamic=True)
    try:
        args = (u.reshape(view), th) if v0 is None else (u.reshape(view), th, v0.reshape(-1, 1).expand(C, 1))
        s, per_pos = fn(*args)
    except Exception as exc:  # inductor needs a working C++ (CPU) or Triton (CUDA) toolchain
        raise BackendError(f"torch.compile of the neuron update failed ({type(exc).__name__}: "
                           f"{str(exc)[:300]}); use neuron='loop'") from exc
    return s.reshape(T, *shape[lead - 1:]), per_pos
