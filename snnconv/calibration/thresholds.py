"""Conversion-side fixes for hard-reset IF networks (``reset="zero"``).

A hard-reset IF neuron (``h = v + x``, fire on ``h >= theta``, ``v = 0`` after a spike,
``v[0] = 0``: spikingjelly's ``IFNode(v_reset=0.)`` and plain NIR ``IF``) is not the QCFS
equivalent that subtractive reset is: it starts empty instead of at theta/2, and every spike
throws away the charge above threshold, so on a constant input ``x`` it fires once every
``ceil(theta / x)`` steps instead of ``x / theta`` times per step. Converted with QCFS
thresholds it under-fires, layer after layer, and a deep network goes silent.

These functions keep the neuron exactly as it is and change only weights, thresholds and
biases:

- :func:`calibrate_thresholds`: layer by layer in graph order, each neuron gets the effective
  threshold ``k * theta`` (``k`` from a grid) and output scale ``c`` (least squares) whose
  output over T steps is closest in mean squared error to the QCFS-ANN's activation at the
  same site, on calibration data, with the layers before it already calibrated; written as a
  scaling of its input layers and consumers so that the threshold stays per layer (loadable
  by spikingjelly) and equal to the value a spike carries.
- :func:`shift_bias`: the per-step shift ``theta / (2T)`` added to the bias of the layer that
  feeds each neuron (over T steps it brings the charge ``theta / 2`` that the subtractive
  neuron starts with).

:func:`snnconv.convert` with ``reset="zero"`` runs :func:`calibrate_thresholds` (then bias
calibration); the measurements behind that choice are in benchmarks/README.md, "hard_reset".
"""

from __future__ import annotations

import copy
import operator
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn as nn

from snnconv.activation import QCFS
from snnconv.calibration.bias import apply_shift, bias_path
from snnconv.calibration.reference import calibration_batches, channel_sums, reference_sites
from snnconv.errors import ConfigError, StageOrderError
from snnconv.graph import call_counts, capture, module_of, prepare
from snnconv.snn.network import SpikingNetwork, check_T
from snnconv.snn.neuron import IFNeuron, Scale, TimeExpand, channel_view
from snnconv.stages.spiking import LAYERS

__all__ = ["DEFAULT_FACTORS", "calibrate_thresholds", "shift_bias"]

#: threshold factors tried by :func:`calibrate_thresholds`: 2^(j/8) for j = -16..16 (0.25 .. 4)
DEFAULT_FACTORS: tuple[float, ...] = tuple(2.0 ** (j / 8) for j in range(-16, 17))


def _check_network(snn: Any, what: str) -> None:
    if not isinstance(snn, SpikingNetwork) or "neurons" not in snn.meta:
        raise StageOrderError(f"{what} needs a SpikingNetwork made by to_spiking (its meta maps "
                              "each neuron to its QCFS site and the layers that carry its scale)")


def _through_time_expand(gm: fx.GraphModule, node: Any) -> Any:
    while isinstance(node, fx.Node) and isinstance(module_of(gm, node), TimeExpand) \
            and len(node.users) == 1:
        node = node.args[0]
    return node


def _input_terms(gm: fx.GraphModule, node: fx.Node, calls: dict[str, int]) -> list[Any] | None:
    """The modules whose outputs sum to IF ``node``'s input and feed nothing else, or None.

    Each is a Conv/Linear or a :class:`Scale`, reached through TimeExpand or one add; scaling
    all of them by ``f`` scales the neuron's input by ``f`` and changes nothing else.
    """
    src = _through_time_expand(gm, node.args[0])
    if not isinstance(src, fx.Node) or len(src.users) != 1:
        return None
    args = [src]
    if src.op == "call_function" and src.target in (operator.add, torch.add) and not src.kwargs:
        args = [_through_time_expand(gm, a) for a in src.args]
    terms: list[Any] = []
    for a in args:
        mod = module_of(gm, a) if isinstance(a, fx.Node) else None
        if not isinstance(mod, (LAYERS, Scale)) or len(a.users) != 1 \
                or calls.get(str(a.target), 0) != 1:
            return None
        terms.append(mod)
    return terms


def _scale_output(mod: Any, f: torch.Tensor) -> None:
    """Multiply ``mod``'s output by ``f`` (scalar, or per output channel) in place."""
    with torch.no_grad():
        if isinstance(mod, Scale):
            mod.theta = nn.Parameter((mod.theta.detach() * f).to(mod.theta.dtype), requires_grad=False)
            return
        view = f if f.dim() == 0 else f.reshape(-1, *([1] * (mod.weight.dim() - 1)))
        mod.weight.mul_(view.to(mod.weight.dtype))
        if mod.bias is not None:
            mod.bias.mul_(f.to(mod.bias.dtype))


def calibrate_thresholds(snn: SpikingNetwork, reference: nn.Module, loader: Any, *,
                         T: int | None = None, num_batches: int = 4,
                         factors: tuple[float, ...] = DEFAULT_FACTORS,
                         rescale: bool = True, per_channel: bool = False) -> SpikingNetwork:
    """Fit each IF layer's threshold and output scale so its output matches the QCFS-ANN's.

    In graph order, for each neuron (threshold ``theta``, output scale ``theta`` carried by the
    weights of its consumers), every ``k`` in ``factors`` is tried: the neuron is run at
    threshold ``k * theta`` on its input in the already-calibrated network over ``T`` steps
    (default ``snn.T``), and its output ``c * spike rate`` is compared with the QCFS output of
    the same site in ``reference`` (the model ``snn`` was made from): with ``rescale=True``
    (default) ``c`` is the least-squares output scale for that ``k``, otherwise ``c = theta``.
    The ``(k, c)`` of least mean squared error is kept. ``per_channel=True`` picks ``k`` per
    channel, with ``c = theta`` (the threshold stays per layer where the input layers can be
    scaled per channel, see below).

    It is written into the network so that the threshold remains the output scale (the
    convention every stage relies on, e.g. :func:`snnconv.calibration.calibrate_bias`): the
    neuron's threshold becomes ``c``, its input layers (the Conv/Linear or shortcut
    :class:`Scale` modules summed into it) are multiplied by ``c / (k * theta)`` (an IF neuron
    that starts at 0 and resets to 0 gives the same spikes for input and threshold scaled
    together), and its consumers' weights by ``c / theta``. Where the input layers are shared
    (or not Conv/Linear/Scale), the threshold becomes ``k * theta`` with ``c = theta`` instead
    (``rescale`` is not applied there), recorded as ``"input_scaled": False``. The neuron
    model is untouched: only weights, biases and thresholds change. Works on a copy;
    ``result.meta["threshold_calibration"]`` records each layer's ``factor``, ``output_scale``
    (``c / theta``) and error before and after.

    Cost: one T-step pass over ``num_batches`` batches (run as one batch), one ANN forward
    that keeps every QCFS site's output (their memory: one float32 copy of each site's
    activations on those batches), and at each neuron ``len(factors)`` runs of that neuron
    alone.

    Raises:
        StageOrderError: ``snn`` was not made by ``to_spiking``, or a neuron module is called
            at several places (its threshold cannot be fitted to one site).
        DataError: the loader is empty.
        ValueError: a bad ``T`` or ``factors``, or ``rescale`` with ``per_channel``.
    """
    _check_network(snn, "calibrate_thresholds")
    T = snn.T if T is None else T
    check_T(T)
    factors = tuple(float(k) for k in factors)
    if not factors or not all(0 < k < float("inf") for k in factors) or 1.0 not in factors:
        raise ConfigError(f"factors must be positive and finite and include 1.0 (the unchanged "
                         f"neuron); got {factors}")
    if rescale and per_channel:
        raise ConfigError("rescale=True fits one output scale per layer; use it with "
                         "per_channel=False, or pass rescale=False for per-channel factors")
    batches = calibration_batches(loader, num_batches, "threshold calibration loader")
    out = copy.deepcopy(snn)
    gm = out.net
    device = next(out.parameters()).device
    batches = [x.to(device) for x in batches]
    x_all = torch.cat(batches) if len(batches) > 1 else batches[0]
    ref = prepare(reference, leaf_types=(QCFS,)).to(device)
    ref_nodes = reference_sites(ref)
    calls = call_counts(gm)
    # every site's QCFS output in one reference pass (float32, the calibration batches)
    targets = capture(ref, (x_all,), list(ref_nodes.values()))
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
        if source not in ref_nodes:
            records[name] = "skipped: no QCFS reference site"
            continue
        terms = _input_terms(gm, node, calls)
        consumers: list[nn.Module] = [gm.get_submodule(n) for n in info.get("absorbed_into", [])]
        consumers += [m for u in node.users if isinstance(m := module_of(gm, u), Scale)]

        def fit(m, args, name=name, source=source, terms=terms, consumers=consumers):
            x = args[0]
            target = targets[ref_nodes[source]]
            theta = m.theta.detach().clone()
            # err(k)[ch] = mean((c u - t)^2) with u = count theta / T, from three per-channel
            # sums: no float64 copy of the [T, B, ...] spikes or the target per factor
            n = target.numel() / target.shape[1]
            th = theta.double() / T
            s_tt = channel_sums(target * target)
            errs, scales = [], []
            try:
                for k in factors:
                    m.theta.data = theta * k
                    count = m.forward(x).reshape(T, -1, *x.shape[1:]).sum(0)  # exact integers
                    s_uu = channel_sums(count * count) * th * th
                    s_ut = channel_sums(count * target) * th
                    c = torch.ones((), dtype=torch.float64, device=x.device)
                    if rescale and terms is not None:
                        uu = s_uu.sum()
                        c = s_ut.sum() / uu if uu > 0 else c
                        if not c > 0:  # a site the reference leaves at zero: keep the scale
                            c = torch.ones((), dtype=torch.float64, device=x.device)
                    errs.append(((c * c * s_uu - 2 * c * s_ut + s_tt) / n).clamp(min=0))
                    scales.append(float(c))
            finally:
                m.theta.data = theta
            errs = torch.stack(errs)  # [factors, C]
            one = factors.index(1.0)
            before = float(errs[one].mean())
            if per_channel:
                pick = errs.argmin(0)
                k = torch.tensor(factors, dtype=theta.dtype, device=theta.device)[pick]
                c, after, chosen = 1.0, float(errs.gather(0, pick[None]).mean()), k.tolist()
            else:
                i = int(errs.mean(1).argmin())
                k = torch.tensor(factors[i], dtype=theta.dtype, device=theta.device)
                c, after, chosen = scales[i], float(errs[i].mean()), factors[i]
            records[name] = {"factor": chosen, "output_scale": c, "mse_before": before,
                             "mse": after, "input_scaled": terms is not None}
            if terms is None:
                m.theta.data = (theta * k).to(theta.dtype)
                return None
            # threshold c*theta on input scaled by c/k: the spikes of threshold k*theta
            f = torch.as_tensor(c, dtype=theta.dtype, device=theta.device) / k
            for t in terms:
                _scale_output(t, f)
            for t in consumers:
                _scale_output_input(t, torch.as_tensor(c, dtype=theta.dtype, device=theta.device))
            m.theta.data = theta * c
            return (x * channel_view(f, x.dim()),)

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
                                         "rescale": bool(rescale), "per_channel": bool(per_channel),
                                         "layers": records}
    return out


def _scale_output_input(mod: Any, c: torch.Tensor) -> None:
    """Multiply what ``mod`` reads from a neuron by scalar ``c`` (its weights, or a Scale's theta)."""
    with torch.no_grad():
        if isinstance(mod, Scale):
            mod.theta = nn.Parameter((mod.theta.detach() * c).to(mod.theta.dtype), requires_grad=False)
        else:
            mod.weight.mul_(c.to(mod.weight.dtype))


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
    check_T(T)
    out = copy.deepcopy(snn)
    gm = out.net
    calls = call_counts(gm)
    record: dict[str, Any] = {}
    for node in gm.graph.nodes:
        mod = module_of(gm, node)
        if not isinstance(mod, IFNeuron):
            continue
        hit = bias_path(gm, node)
        if hit is None or calls.get(str(hit[0].target), 0) != 1:
            record[str(node.target)] = "skipped: no Conv/Linear of its own feeds it"
            continue
        shift = mod.theta.detach() / (2 * T)
        apply_shift(cast(nn.Module, module_of(gm, hit[0])), shift)
        record[str(node.target)] = {"layer": str(hit[0].target), "shift": shift.tolist()}
    out.meta = copy.deepcopy(snn.meta)
    out.meta["bias_shift"] = {"T": T, "layers": record}
    return out
