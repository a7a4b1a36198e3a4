"""Bias and membrane calibration, one neuron at a time: the spike counts of an IF neuron on its
input over the calibration steps, its spikes with a bias shift folded into the threshold, and
the shift (and initial membrane) that brings its mean output to the reference's."""

from __future__ import annotations

from typing import Any

import torch

from snnconv.calibration.reference import channel_sums
from snnconv.snn.neuron import IFNeuron, channel_view, emit, fire_subtractive_

__all__ = ["spike_counts", "charge_counts", "fire", "counted", "fit_shift"]


def spike_counts(mod: IFNeuron, seq: torch.Tensor, steps: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per channel (dim 1 of a step), the spikes of IF ``mod`` on the input ``seq`` ``[T, b,
    ...]`` over the first ``t`` steps, summed over the images and positions, for each ``t`` in
    ``steps`` (float64). The same arithmetic as :func:`snnconv.snn.neuron.fire_subtractive_` and
    :func:`~snnconv.snn.neuron.fire_zero`, step by step (the same spikes, tested), but the spike
    train is never stored: a running count per position is all calibration needs."""
    step = seq[0]
    dims = [d for d in range(step.dim()) if d != 1]
    counts, wanted = {}, set(steps)
    cnt = torch.zeros_like(step)
    spk = torch.empty_like(step)
    if mod.reset == "zero":
        theta = channel_view(mod.theta, step.dim())
        v = step.clone()
    else:
        theta = channel_view(mod.theta, step.dim())
        buf = torch.empty_like(step)
        v = step / theta + channel_view(mod.v_init.to(step.dtype), step.dim())
    for t in range(max(steps)):
        if mod.reset == "zero":
            if t:
                v.add_(seq[t])
            torch.ge(v, theta, out=spk)
            v.addcmul_(v, spk, value=-1.0)
        else:
            if t:
                v.add_(torch.div(seq[t], theta, out=buf))
            emit(v, mod.burst, out=spk)
            v.sub_(spk)
        cnt.add_(spk)
        if t + 1 in wanted:
            counts[t + 1] = cnt.double().sum(dim=dims)
    return counts


def charge_counts(mod: IFNeuron, u: torch.Tensor, steps: tuple[int, ...],
                  charges: list | None = None) -> dict[int, torch.Tensor]:
    """:func:`spike_counts` of a subtractive-reset neuron on its input already divided by
    theta (``u``, ``[T, b, ...]``), without a running count: after ``t`` steps a position has
    fired ``v_init + u[0] + ... + u[t-1] - v[t]`` times (its charge in, minus what is left), so
    the channel sums of ``u`` and of the membrane at the wanted steps give the same counts up to
    float rounding, for three tensor operations per step instead of five. ``charges`` (a list)
    receives each position's charge over all the steps of ``u``, for :func:`fire`'s rates."""
    step = u[0]
    v0 = channel_view(mod.v_init.to(step.dtype), step.dim())
    per_channel = step.numel() // step.shape[1]
    counts: dict[int, torch.Tensor] = {}
    charge: Any = 0.0  # a float until the first step's sums
    done, total = 0, None
    spk = torch.empty_like(step)
    v = step + v0
    for t in range(max(steps)):
        if t:
            v.add_(u[t])
        emit(v, mod.burst, out=spk)
        v.sub_(spk)
        if t + 1 in steps:
            if charges is None:
                # positions summed in float32 first (a float64 reduction over these strided
                # dimensions is 20x slower)
                charge = charge + channel_sums(u[done:t + 1].reshape(-1, *step.shape[1:]))
            else:
                part = u[done:t + 1].sum(0)  # each position's charge over these steps
                total = part if total is None else total + part
                charge = charge + channel_sums(part)
            done = t + 1
            start = mod.v_init.double().expand(step.shape[1]) * per_channel
            counts[t + 1] = start + charge - channel_sums(v)
    if charges is not None:
        charges.append(total if done == len(u) else None)
    return counts


def fire(mod: IFNeuron, u: torch.Tensor, shift: torch.Tensor | None = None,
         charge: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The spikes, in place of ``u`` (``[T, b, ...]``, the input divided by theta), of the
    subtractive-reset IF neuron ``mod``. With ``shift`` (per channel, in units of theta) the
    input is raised by it at every step: the membrane is kept without the shift and compared
    with ``1 - (t+1) * shift`` instead, which saves adding the shift to the input. With
    ``charge`` (each position's ``u`` summed over the steps, from :func:`charge_counts`) also
    the spike rates ``[b, ...]``: the count is ``v_init + charge - v`` at the end (the kept
    membrane, exactly; rounded to the integer it is up to float rounding), no pass over the
    spikes."""
    step = u[0]
    v0 = channel_view(mod.v_init.to(step.dtype), step.dim())
    thresholds = None
    if shift is not None:  # the thresholds of all steps at once
        steps = torch.arange(1, u.shape[0] + 1, dtype=step.dtype, device=step.device)
        thresholds = 1.0 - steps.reshape(-1, *[1] * shift.dim()) * shift.to(step.dtype)
    v = fire_subtractive_(u, v0, thresholds, burst=mod.burst)
    if charge is None:
        return u
    return u, v.neg_().add_(charge).add_(v0).round_().div_(u.shape[0])


def _rates(mod: IFNeuron, parts: list[tuple[dict[int, torch.Tensor], int, int]], n_batches: int,
           steps: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per channel, ``theta`` times the mean spike rate over the first ``t`` steps, for each
    ``t`` in ``steps``: the mean over the images of each calibration batch, then over the
    batches. ``parts``: (counts of :func:`spike_counts`, positions per channel, batch index)."""
    sums: dict[int, list[Any]] = {t: [0.0] * n_batches for t in steps}
    positions = [0] * n_batches
    for counts, n, k in parts:
        positions[k] += n
        for t in steps:
            sums[t][k] = sums[t][k] + counts[t]
    theta = mod.theta.detach().double()
    return {t: sum(sums[t][k] / (positions[k] * t) for k in range(n_batches)) / n_batches * theta
            for t in steps}


def counted(mod: IFNeuron | None, x: torch.Tensor, T: int, k: int, steps: tuple[int, ...]):
    """One part for :func:`_rates`: the spike counts of ``mod`` on ``x`` (``[T*b, ...]``) of
    batch ``k``; with ``mod=None``, ``x`` are the spikes themselves."""
    seq = x.reshape(T, len(x) // T, *x.shape[1:])
    if mod is not None:
        counts = spike_counts(mod, seq, steps)
    else:
        dims = [d for d in range(seq.dim() - 1) if d != 1]
        counts, acc, done = {}, None, 0
        for t in sorted(steps):  # prefix sums over time
            part = seq[done:t].sum(0)
            acc, done = (part if acc is None else acc + part), t
            counts[t] = acc.double().sum(dim=dims)
    return counts, seq[0].numel() // seq.shape[2], k


def fit_shift(mod: IFNeuron, parts: list, n_batches: int, T: int, target: Any,
              horizons: tuple[int, int] | None, membrane: bool = False) -> torch.Tensor:
    """The bias shift for IF ``mod`` from its spike counts (``parts``, see :func:`_rates`); with
    ``horizons`` it also moves ``mod.v_init``. Per channel, the error to the reference mean is
    modelled as ``a + b / t`` over ``t`` steps and solved at the two horizons: ``a`` goes to the
    bias and ``b`` (input units, divided by theta) to the initial membrane, kept in ``[0, 1]``.
    ``membrane``: the error ``e`` at ``T`` steps goes to the initial membrane (``b = e * T``),
    and to the bias only what the clamp leaves."""
    if horizons is None and not membrane:
        return target - _rates(mod, parts, n_batches, (T,))[T]
    if membrane:
        t = T
        e = target - _rates(mod, parts, n_batches, (T,))[T]
        b = e * T
    else:
        assert horizons is not None  # (the two branches above take the other cases)
        (t1, t), (m1, m2) = horizons, (target[0], target[1])
        r = _rates(mod, parts, n_batches, (t1, t))
        e1, e = m1 - r[t1], m2 - r[t]
        b = (e1 - e) / (1.0 / t1 - 1.0 / t)
    th = mod.theta.detach().double()
    old = mod.v_init.double()
    v0 = (old + b / th).clamp(0.0, 1.0)
    with torch.no_grad():
        mod.v_init = v0.to(torch.float32)
    return e - (v0 - old) * th / t  # the error at t that the clamped membrane left, to the bias

