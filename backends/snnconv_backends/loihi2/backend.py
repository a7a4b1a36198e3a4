"""The ``loihi2-sim`` backend: options, input checks, and the program that runs a quantised
network in chunks."""

from __future__ import annotations

import time
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from snnconv.errors import BackendError
from snnconv_backends.loihi2.chip import STEP_SECONDS
from snnconv_backends.loihi2.fidelity import QuantisationWarning, check, summary
from snnconv_backends.loihi2.network import QuantizedNetwork
from snnconv_backends.loihi2.quantisation import quantize
from snnconv_backends.loihi2.report import build_result, chip_report
from snnconv_backends.loihi2.simulate import RuntimeCounters, run_quantized
from snnconv_backends.registry import (
    Backend,
    Program,
    Report,
    RunResult,
    check_finite,
    check_rule,
    parse_graph,
    readout_exit,
)

__all__ = ["Loihi2SimBackend", "Loihi2Program", "OPTIONS", "check_input"]

#: The options of ``loihi2-sim`` and their defaults.
OPTIONS = {"device": "cpu", "record": False, "step_seconds": STEP_SECONDS, "batch_size": None,
           "weight_bits": 8, "split_signs": True, "weight_groups": "auto", "dt": 1.0,
           "per_neuron_vth": True, "reference": True, "mse_exponents": False}


def _check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise BackendError(f"{name}: unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    out = dict(OPTIONS)
    out.update(options)
    return out


def check_input(q: QuantizedNetwork, x: Any, T: Any, name: str) -> tuple[torch.Tensor, int]:
    """Validate ``x`` (a static batch ``[B, *input_shape]``, B >= 1, finite values) and ``T``."""
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise BackendError(f"{name}: T must be an integer >= 1, got {T!r}")
    if not isinstance(x, torch.Tensor):
        raise BackendError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    shape = tuple(q.graph.input_shape)
    if tuple(x.shape[1:]) != shape:
        if x.dim() == len(shape) + 2 and tuple(x.shape[2:]) == shape:
            raise BackendError(
                f"{name}: a per-step input [T, B, ...] cannot be run: the static first layer is "
                "mapped to bias currents (direct encoding); give a static batch [B, ...]")
        raise BackendError(f"{name}: x has shape {tuple(x.shape)}; expected [B, {', '.join(map(str, shape))}]")
    if not x.is_floating_point():
        raise BackendError(f"{name}: x must be floating point, got {x.dtype}")
    if x.shape[0] == 0:
        raise BackendError(f"{name}: the batch is empty (shape {tuple(x.shape)}); give at least one input")
    check_finite(x, name)
    return x, int(T)


class Loihi2Program(Program):
    """A graph quantised for Loihi 2; ``run(x, T)`` simulates it bit-exactly (batched)."""

    def __init__(self, q: QuantizedNetwork, options: Mapping[str, Any]):
        self.q = q
        self.options = dict(options)
        self.device = torch.device(self.options["device"])

    def report(self, runs: list[RunResult], *, analog_macs_per_image: float = 0.0) -> Report:
        """Quantisation, resources, latency and energy over ``runs``, and the quantisation check
        over all their images (:func:`.report.chip_report`)."""
        return chip_report(self.q, runs, "loihi2-sim", analog_macs_per_image)

    def run(self, x: torch.Tensor, T: int, *, exit_rule: Any = None) -> RunResult:
        """``exit_rule``: an :class:`snnconv.exit_rule.ExitRule`; the simulation runs all T steps,
        and each image's spikes, synaptic operations, neuron updates and energy count only its
        steps up to the one where the rule met its readout (``extra["early_exit"]``,
        :func:`readout_exit`)."""
        x, T = check_input(self.q, x, T, "loihi2-sim")
        check_rule(exit_rule, "loihi2-sim")
        t0 = time.perf_counter()
        x = x.to(self.device)
        bs = self.options["batch_size"]
        if bs is None:  # cache-sized chunks on a CPU (256 time-folded samples), 256 images on a GPU
            bs = 256 if self.device.type != "cpu" else max(1, 256 // T)
        bs = max(1, int(bs))
        record = bool(self.options["record"])
        outs: list = []
        cnt: dict = {}
        spk: dict = {}
        vlt: dict = {}
        stats = RuntimeCounters()
        synops: dict[str, float] = {}
        ran: list = []
        with torch.no_grad():
            for part in x.split(bs):
                o, c, s, v, st, sy, steps = run_quantized(self.q, part, T, record=record, exit_rule=exit_rule)
                outs.append(o)
                ran.append(steps.cpu())
                for k, val in c.items():
                    cnt[k] = cnt[k] + val if k in cnt else val
                for k, val in s.items():
                    # a burst population's graded spikes keep their counts
                    spk.setdefault(k, []).append((val.to(torch.uint8) if self.q.population(k).burst > 1
                                                  else val.bool()).cpu())
                for k, val in v.items():
                    vlt.setdefault(k, []).append(val.cpu())
                for a in ("saturated", "wrapped", "bias_clipped"):
                    setattr(stats, a, getattr(stats, a) + getattr(st, a))
                for k, val in st.spikes_all_steps.items():
                    every = stats.spikes_all_steps
                    every[k] = every[k] + val if k in every else val
                for k, val in sy.items():
                    synops[k] = synops.get(k, 0.0) + val
        extra: dict[str, Any] = {"seconds": time.perf_counter() - t0}
        if record:
            extra["trace"] = {"v": {k: torch.cat(v, dim=1) for k, v in vlt.items()},
                              "s": {k: torch.cat(v, dim=1) for k, v in spk.items()}}
        steps = torch.cat(ran)
        res = build_result(self.q, torch.cat(outs, dim=1), cnt, stats, synops, T, x.shape[0],
                           float(self.options["step_seconds"]), extra,
                           steps=None if exit_rule is None else steps)
        if exit_rule is not None:
            res = readout_exit(res, exit_rule, "loihi2-sim", steps=steps)
        every = {k: v.reshape(T).float().cpu() for k, v in stats.spikes_all_steps.items()}
        return attach_fidelity(self.q, res, x, T, "loihi2-sim", bool(self.options["reference"]), every)


def _decisions(outputs: torch.Tensor) -> torch.Tensor:
    """Each image's decision: the readout averaged over T, its largest entry."""
    return outputs.detach().cpu().double().mean(0).reshape(outputs.shape[1], -1).argmax(1)


def attach_fidelity(q: QuantizedNetwork, res: RunResult, x: torch.Tensor, T: int, name: str,
                    reference: bool, counts: Mapping[str, torch.Tensor] | None = None) -> RunResult:
    """Add ``extra["fidelity"]`` (per-layer firing rates against the float network run on the
    same batch by the cpu backend, weights flushed; :mod:`.fidelity`) and warn
    (:class:`QuantisationWarning`) where they depart beyond the tolerances. ``counts``: the
    run's spikes at every step (default ``res.spikes``; an early exit cuts those), kept as
    ``extra["fidelity"]["counts"]``."""
    ref, decisions = None, None
    if reference:
        from snnconv_backends.cpu import compile_parsed

        with torch.no_grad():
            float_run = compile_parsed(q.graph).run(x.detach().cpu().float(), T)
        ref = float_run.spikes
        same = _decisions(res.outputs) == _decisions(float_run.outputs)
        decisions = (int(same.sum()), int(same.numel()))
    fid = check(q, res.spikes if counts is None else counts, ref, int(x.shape[0]), T, decisions)
    fid["float_counts"] = None if ref is None else {k: v.reshape(-1).tolist() for k, v in ref.items()}
    fid["counts"] = {k: v.reshape(-1).tolist() for k, v in (res.spikes if counts is None else counts).items()}
    res.extra["fidelity"] = fid
    if fid["warnings"]:
        warnings.warn(summary(fid, name), QuantisationWarning, stacklevel=3)
    return res


class Loihi2SimBackend(Backend):
    """Bit-exact fixed-point Loihi 2 model (Lava's arithmetic), vectorised with torch.

    Options: ``device`` ("cpu" or a CUDA device), ``record`` (membrane traces in
    ``extra["trace"]``), ``step_seconds`` (latency estimate), ``batch_size`` (images per
    chunk; default ``256 // T`` on a CPU, where cache-sized chunks run fastest, else 256),
    ``weight_bits`` (8, Loihi's synapses; more, or a mapping connection -> bits, only to
    measure what the 8-bit budget costs: such a network cannot run on the chip),
    ``split_signs`` (default True: mixed-sign connections as excitatory + inhibitory synapse
    groups, 8 bits of magnitude each; False: Lava's mixed sign mode, 7), ``weight_groups``
    (1, or 2: each connection's rounding residual as a second synapse group, ~15-bit weights
    at twice the synapses; or a mapping connection -> groups; see :func:`quantize`),
    ``per_neuron_vth`` (default True: one threshold per channel where one per population would
    be below 2**10), ``mse_exponents`` (default False: see :func:`quantize`), ``reference`` (default True: also
    run the float network on the batch and
    compare each layer's firing rate, ``extra["fidelity"]``; a departure beyond the tolerances
    of :mod:`.fidelity` warns with :class:`~snnconv_backends.loihi2.fidelity.QuantisationWarning`).
    """

    name = "loihi2-sim"

    def compile(self, graph: Any, **options: Any) -> Loihi2Program:
        opts = _check_options(self.name, options)
        return Loihi2Program(quantize(parse_graph(graph, self.name, opts["dt"]), weight_bits=opts["weight_bits"],
                                      split_signs=bool(opts["split_signs"]),
                                      weight_groups=opts["weight_groups"],
                                      per_neuron_vth=bool(opts["per_neuron_vth"]),
                                      mse_exponents=bool(opts["mse_exponents"])), opts)
