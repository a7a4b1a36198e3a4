"""Conversion-side fixes for hard-reset IF networks (``reset="zero"``).

A hard-reset IF neuron (``h = v + x``, fire on ``h >= theta``, ``v = 0`` after a spike,
``v[0] = 0``: spikingjelly's ``IFNode(v_reset=0.)`` and plain NIR ``IF``) is not the QCFS
equivalent that subtractive reset is: it starts empty instead of at theta/2, and every spike
throws away the charge above threshold, so on a constant input ``x`` it fires once every
``ceil(theta / x)`` steps instead of ``x / theta`` times per step. Converted with QCFS
thresholds it under-fires, layer after layer, and a deep network goes silent.

These functions keep the neuron exactly as it is and change only thresholds and biases:

- :func:`calibrate_thresholds`: layer by layer in graph order, each neuron's threshold becomes
  ``k * theta`` with ``k`` picked from a grid so that the neuron's output over T steps
  (``theta_out * spike rate``, where ``theta_out`` is the scale its consumers' weights carry)
  is closest in mean squared error to the QCFS-ANN's activation at the same site, on
  calibration data, with the layers before it already calibrated. Per layer by default (a
  per-layer threshold stays loadable by spikingjelly), per channel on request.
- :func:`shift_bias`: the per-step shift ``theta / (2T)`` added to the bias of the layer that
  feeds each neuron (over T steps it brings the charge ``theta / 2`` that the subtractive
  neuron starts with).

:func:`snnconv.convert` with ``reset="zero"`` runs :func:`calibrate_thresholds` (then bias
calibration); see ``pending_docs/hard.md`` for the measurements behind that choice.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from .data import split_batch
from .errors import DataError, StageOrderError
from .graph import capture, module_of, prepare
from .qcfs import QCFS
from .spiking import (IFNeuron, SpikingNetwork, _apply_shift, _bias_path, _channel_view,
                      _check_T, _shift_reaches_only)

__all__ = ["DEFAULT_FACTORS", "DEFAULT_SHIFTS", "SHIFT_GRID", "calibrate_thresholds", "shift_bias"]

#: threshold factors tried by :func:`calibrate_thresholds`: 2^(j/8) for j = -16..5 (0.25 .. 1.54)
DEFAULT_FACTORS: tuple[float, ...] = tuple(2.0 ** (j / 8) for j in range(-16, 6))
#: per-step bias shifts tried by default: none (a shift grid such as :data:`SHIFT_GRID` costs
#: ``len(shifts)`` times more and did not raise accuracy on digits; see pending_docs/hard.md)
DEFAULT_SHIFTS: tuple[float, ...] = (0.0,)
#: a shift grid, as the charge added over the whole run in units of the new threshold (``c``
#: adds ``c * theta' / T`` per step; 0.5 is the phi = 1/2 of QCFS)
SHIFT_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def _calibration_batches(loader: Any, num_batches: int, where: str) -> list[torch.Tensor]:
    batches = []
    for batch in loader:
        if len(batches) >= num_batches:
            break
        batches.append(split_batch(batch, where=where)[0])
    if not batches:
        raise DataError(f"the {where} is empty: it yielded no batch")
    return batches


def _check_network(snn: Any, what: str) -> None:
    if not isinstance(snn, SpikingNetwork) or "neurons" not in snn.meta:
        raise StageOrderError(f"{what} needs a SpikingNetwork made by to_spiking (its meta maps "
                              "each neuron to its QCFS site and the scale its consumers carry)")


def calibrate_thresholds(snn: SpikingNetwork, reference: nn.Module, loader: Any, *,
                         T: int | None = None, num_batches: int = 4,
                         factors: tuple[float, ...] = DEFAULT_FACTORS,
                         shifts: tuple[float, ...] = DEFAULT_SHIFTS,
                         per_channel: bool = False) -> SpikingNetwork:
    """Fit each IF layer's threshold (and a bias shift) so its output matches the QCFS-ANN's.

    In graph order, for each neuron with threshold ``theta`` whose spikes its consumers read
    as ``theta_out`` (the threshold it was converted with, absorbed into their weights), every
    pair ``(k, c)`` of ``factors`` x ``shifts`` is tried: the neuron runs at threshold
    ``theta' = k * theta`` on its input in the already-calibrated network plus ``c * theta' / T``
    per step, over ``T`` steps (default ``snn.T``), and the pair whose ``theta_out * spike
    rate`` has the smallest mean squared error against the QCFS output of the same site in
    ``reference`` (the model ``snn`` was made from) is kept: the threshold becomes ``theta'``
    and the shift goes into the bias of the Conv/Linear that feeds the neuron (only ``c = 0`` is
    tried where there is none of its own). ``per_channel=True`` picks ``k`` per channel (the
    threshold becomes per channel). The neuron model is untouched; only thresholds and biases
    change. Works on a copy; ``result.meta["threshold_calibration"]`` records each layer's
    ``factor``, ``shift`` and its error before (``mse_before``) and after (``mse``).

    Cost: one T-step pass over ``num_batches`` batches (run as one batch), plus at each neuron
    ``len(factors) * len(shifts)`` runs of that neuron alone and one ANN forward.

    Raises:
        StageOrderError: ``snn`` was not made by ``to_spiking``, or a neuron module is called
            at several places (its threshold cannot be fitted to one site).
        DataError: the loader is empty.
        ValueError: a bad ``T``, ``factors`` or ``shifts``.
    """
    _check_network(snn, "calibrate_thresholds")
    T = snn.T if T is None else T
    _check_T(T)
    factors = tuple(float(k) for k in factors)
    shifts = tuple(float(c) for c in shifts)
    if not factors or not all(0 < k < float("inf") for k in factors):
        raise ValueError(f"factors must be positive and finite, got {factors}")
    if 1.0 not in factors or 0.0 not in shifts or not all(abs(c) < float("inf") for c in shifts):
        raise ValueError("factors must include 1.0 and shifts 0.0 (the unchanged neuron), all "
                         f"finite; got factors={factors}, shifts={shifts}")
    batches = _calibration_batches(loader, num_batches, "threshold calibration loader")
    out = copy.deepcopy(snn)
    gm = out.net
    device = next(out.parameters()).device
    batches = [x.to(device) for x in batches]
    x_all = torch.cat(batches) if len(batches) > 1 else batches[0]
    ref = prepare(reference, leaf_types=(QCFS,)).to(device)
    ref_nodes = {str(n.target): n.name for n in ref.graph.nodes
                 if n.op == "call_module" and isinstance(module_of(ref, n), QCFS)}
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    records: dict[str, Any] = {}
    handles = []
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if not isinstance(mod, IFNeuron):
            continue
        name = str(node.target)
        if calls[name] != 1:
            raise StageOrderError(f"IF neuron '{name}' is called at {calls[name]} places; "
                                  "calibrate_thresholds fits one threshold per call site")
        info = snn.meta["neurons"].get(name, {})
        source = info.get("source")
        if source not in ref_nodes or "theta" not in info:
            records[name] = "skipped: no QCFS reference site"
            continue
        hit = _bias_path(gm, node)
        layer = None
        if hit is not None and _shift_reaches_only(gm, node, hit, calls):
            layer = module_of(gm, hit[0])
        theta_out = torch.as_tensor(info["theta"], dtype=torch.float32, device=device)

        def fit(m, args, name=name, source=source, theta_out=theta_out, layer=layer):
            x = args[0]
            target = capture(ref, (x_all,), [ref_nodes[source]])[ref_nodes[source]]
            base = m.theta.detach().clone()
            grid = [(k, c) for k in factors for c in (shifts if layer is not None else (0.0,))]
            errs = []
            try:
                for k, c in grid:
                    m.theta.data = base * k
                    xs = x if c == 0 else x + _view(layer, base * k * (c / T), x.dim())
                    rate = m.forward(xs).reshape(T, -1, *x.shape[1:]).mean(0)
                    d = (rate * _channel_view(theta_out, rate.dim()) - target).double() ** 2
                    errs.append(d.mean(dim=[i for i in range(d.dim()) if i != 1]))
            finally:
                m.theta.data = base
            errs = torch.stack(errs)  # [len(grid), C]
            before = float(errs[grid.index((1.0, 0.0))].mean())
            if per_channel:
                # per channel, the best k at the one shift c that is best for the layer overall
                c_best = grid[int(errs.mean(1).argmin())][1]
                rows = [i for i, (_, c) in enumerate(grid) if c == c_best]
                pick = errs[rows].argmin(0)
                k_ch = torch.tensor([grid[rows[int(i)]][0] for i in pick], dtype=base.dtype,
                                    device=base.device)
                new = base * k_ch
                after = float(errs[rows].gather(0, pick[None]).mean())
                chosen: Any = k_ch.tolist()
            else:
                i = int(errs.mean(1).argmin())
                k, c_best = grid[i]
                new = base * k
                after = float(errs[i].mean())
                chosen = k
            m.theta.data = new.to(base.dtype)
            records[name] = {"factor": chosen, "shift": c_best, "mse_before": before, "mse": after}
            if c_best == 0:
                return None
            added = _apply_shift(layer, new * (c_best / T))
            return (x + _view(layer, added, x.dim()),)

        handles.append(mod.register_forward_pre_hook(fit))
    old_T = out.T
    out.T = T
    try:
        with torch.no_grad():
            gm(x_all)
    finally:
        for h in handles:
            h.remove()
        out.T = old_T
    out.meta = copy.deepcopy(snn.meta)
    out.meta["threshold_calibration"] = {"T": T, "batches": len(batches), "factors": list(factors),
                                         "shifts": list(shifts), "per_channel": bool(per_channel),
                                         "layers": records}
    return out


def _view(layer: nn.Module, shift: torch.Tensor, ndim: int) -> torch.Tensor:
    """``shift`` (scalar or per output channel of ``layer``) shaped to add to its output."""
    if shift.dim() == 0 or isinstance(layer, nn.Linear):
        return shift  # a Linear's bias runs along the last dimension
    return _channel_view(shift, ndim)


def shift_bias(snn: SpikingNetwork, T: int | None = None) -> SpikingNetwork:
    """Add ``theta / (2T)`` to the bias of the Conv/Linear that feeds each IF neuron.

    Over ``T`` steps this is the charge ``theta / 2`` that the subtractive neuron starts with
    (QCFS's phi = 1/2), delivered to a neuron that starts at 0. ``theta`` is the neuron's
    current threshold (per layer or per channel). Neurons with no Conv/Linear right before
    them (through TimeExpand or one branch of an add) are left alone and listed in
    ``result.meta["bias_shift"]``. Works on a copy.
    """
    _check_network(snn, "shift_bias")
    T = snn.T if T is None else T
    _check_T(T)
    out = copy.deepcopy(snn)
    gm = out.net
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    record: dict[str, Any] = {}
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if not isinstance(mod, IFNeuron):
            continue
        hit = _bias_path(gm, node)
        if hit is None or calls.get(str(hit[0].target), 0) != 1:
            record[str(node.target)] = "skipped: no Conv/Linear of its own feeds it"
            continue
        shift = mod.theta.detach() / (2 * T)
        _apply_shift(module_of(gm, hit[0]), shift)
        record[str(node.target)] = {"layer": str(hit[0].target), "shift": shift.tolist()}
    out.meta = copy.deepcopy(snn.meta)
    out.meta["bias_shift"] = {"T": T, "layers": record}
    return out
