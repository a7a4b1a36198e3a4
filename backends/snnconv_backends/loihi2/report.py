"""Reports of a run: the quantisation record, the RunResult with resources, latency and energy,
and their human-readable text."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from snnconv_backends.loihi2.cost import ann_macs, energy, resources, with_analog_prefix
from snnconv_backends.loihi2.fidelity import check, summary
from snnconv_backends.loihi2.network import QuantizedNetwork
from snnconv_backends.registry import Report, RunResult

__all__ = ["quantisation_report", "build_result", "format_report", "merge_runs", "chip_report"]


def quantisation_report(q: QuantizedNetwork) -> dict[str, Any]:
    """Per population: threshold, scale, depth, and per connection exponent, bits and error."""
    rep = {}
    for p in q.populations:
        rep[p.name] = dict(p.report, depth=p.depth, reset=p.reset, role=p.role,
                           connections={c.name: dict(c.report, source=c.source, delay=c.delay,
                                                     kind=c.kind) for c in p.conns})
    return rep


def merge_runs(results: Sequence[RunResult]) -> dict[str, Any]:
    """One ``extra`` for several runs of one program: runtime counters summed, per-image energy
    figures averaged over the images."""
    ex = dict(results[-1].extra)
    if len(results) == 1:
        return ex
    if "quantisation" in ex:
        rt = {k: sum(int(r.extra["quantisation"]["runtime"].get(k, 0)) for r in results)
              for k in ("saturated", "wrapped", "bias_clipped")}
        ex["quantisation"] = dict(ex["quantisation"], runtime=rt)
    if "energy" in ex:
        n = [int(r.outputs.shape[1]) for r in results]
        e = dict(ex["energy"])
        for k in ("per_image_J", "synops_per_image", "neuron_updates_per_image", "spikes_per_image",
                  "ann_macs_per_image", "ann_per_image_J", "steps_per_image"):
            if k in e:
                e[k] = sum(r.extra["energy"][k] * b for r, b in zip(results, n)) / sum(n)
        e["snn_over_ann"] = e["per_image_J"] / e["ann_per_image_J"] if e["ann_per_image_J"] else float("inf")
        ex["energy"] = e
    if "latency" in ex:  # an early exit's mean steps differ between runs
        lat = dict(ex["latency"])
        n = [int(r.outputs.shape[1]) for r in results]
        lat["steps"] = sum(r.extra["latency"]["steps"] * b for r, b in zip(results, n)) / sum(n)
        lat["seconds"] = lat["steps"] * lat["step_seconds"]
        ex["latency"] = lat
    return ex


def _steps_text(ex: dict[str, Any], T: int) -> str:
    """``T 8``, or with an early exit the mean steps the images ran of T."""
    e = ex.get("early_exit")
    if e and e.get("counted") == "to exit":
        return f"a mean of {ex['energy']['steps_per_image']:.2f} of T {T} steps, early exit"
    return f"T {T}"


def format_report(result: RunResult | Sequence[RunResult] | Mapping[str, Any]) -> str:
    """Human-readable text of a loihi2-sim / lava run's ``extra``: quantisation, resources,
    latency and energy (several runs of one program: counters summed, energy averaged; a mapping:
    an ``extra`` already merged, :func:`merge_runs`)."""
    ex = (dict(result) if isinstance(result, Mapping) else
          merge_runs([result] if isinstance(result, RunResult) else list(result)))
    lines = []
    q = ex.get("quantisation", {})
    if q:
        lines.append("quantisation (per population: vth, worst-case a_in within the 16-bit budget; "
                     "per connection: weight exponent, largest |mantissa| (8-bit; mixed sign: even "
                     "values), relative RMS rounding error, weights rounded to zero, extra delay):")
        for name, r in q.get("layers", {}).items():
            lines.append(f"  {name:<24} depth {r['depth']:>2}  vth {r.get('vth', 0):>6}  "
                         f"a_in<= {r.get('a_in_bound', '-')}"
                         + (f"  du {r.get('du', 4095)} dv {r['dv']} (dt/tau rounded to 4096ths)"
                            if "dv" in r else "")
                         + (f"  WARNING: {r['warning']}" if "warning" in r else ""))
            for cn, c in r["connections"].items():
                lines.append(f"      <- {cn:<20} {c['kind']:<6} exp {c['exp']:>3}  |m|<={c['mant_max']:>3} "
                             f"{c['sign_mode'][:5]:<5}  "
                             f"err {100 * c['rel_error']:.2f}%  zeroed {c['zero_rounded']}  "
                             f"delay +{c['delay']}")
        rt = q.get("runtime", {})
        lines.append(f"  runtime: saturated {rt.get('saturated', 0)}, wrapped {rt.get('wrapped', 0)}, "
                     f"first-layer bias clipped {rt.get('bias_clipped', 0)} (spike-preserving)")
    r = ex.get("resources")
    if r:
        lines.append(f"resources: {r['neurons']} neurons, {r['synapses']} synapses, "
                     f"{r['cores']} cores, {r['chips']} chip(s)  [{r['source']}]")
        for name, layer in r["layers"].items():
            lines.append(f"  {name:<24} neurons {layer['neurons']:>7}  synapses {layer['synapses_in']:>9}  "
                         f"fan-in {layer['fan_in_mean']:.1f}  fan-out {layer.get('fan_out_mean', 0):.1f}  "
                         f"cores {layer['cores']}")
    lat = ex.get("latency")
    if lat:
        lines.append(f"latency: {lat['steps']:g} steps ({_steps_text(ex, lat['T'])} + pipeline depth {lat['depth']}), "
                     f"about {lat['seconds'] * 1e3:.3f} ms at {lat['step_seconds'] * 1e6:.0f} us/step "
                     f"({lat['note']})")
    e = ex.get("energy")
    if e:
        lines.append(f"energy per image, {e.get('model', 'chip figures')}: SNN {e['per_image_J'] * 1e6:.3f} uJ "
                     f"({e['synops_per_image']:.3g} synops, {e['spikes_per_image']:.3g} spikes, "
                     f"{e['neuron_updates_per_image']:.3g} neuron updates) vs ANN "
                     f"{e['ann_per_image_J'] * 1e6:.3f} uJ ({e['ann_macs_per_image']:.3g} MACs): "
                     f"SNN/ANN {e['snn_over_ann']:.2f}")
        if e.get("analog_prefix_macs_per_image"):
            lines.append(f"  (both sides include the analog prefix's {e['analog_prefix_macs_per_image']:.3g} MACs, "
                         "run off the chip)")
        lines.append(f"  ({e['sources']})")
    return "\n".join(lines)


def build_result(q: QuantizedNetwork, out: torch.Tensor, counts: Mapping[str, torch.Tensor],
                 stats: Any, synops: Mapping[str, float], T: int, B: int, step_seconds: float,
                 extra: Mapping[str, Any] | None = None, steps: torch.Tensor | None = None) -> RunResult:
    """Assemble a RunResult with the quantisation, resource, latency and energy reports.
    ``steps``: each image's steps where it left at an early exit (``counts`` and ``synops``
    then count those steps only); latency and neuron updates follow their mean."""
    counts = {k: v.reshape(T).float().cpu() for k, v in counts.items()}
    macs = ann_macs(q.graph, B)
    total = float(sum(float(c.sum()) for c in counts.values()))
    mean_steps = None if steps is None else float(steps.double().mean())
    steps_run = (T if mean_steps is None else mean_steps) + q.depth
    ex: dict[str, Any] = {"quantisation": {"layers": quantisation_report(q),
                           "runtime": {"saturated": int(stats.saturated), "wrapped": int(stats.wrapped),
                                       "bias_clipped": int(stats.bias_clipped)}},
          "resources": resources(q),
          "latency": {"T": T, "depth": q.depth, "steps": steps_run, "step_seconds": step_seconds,
                      "seconds": steps_run * step_seconds,
                      "note": "per-step time is an assumed order of magnitude, not a measurement"},
          "energy": energy(q, T, B, synops, total, macs, mean_steps)}
    ex["static_ops"] = [op.name for op in q.static_ops]
    if extra:
        ex.update(extra)
    return RunResult(outputs=out.cpu(), spikes=counts, synops=dict(synops), macs=macs, extra=ex)


def chip_report(q: QuantizedNetwork, runs: list[RunResult], name: str, analog_macs_per_image: float = 0.0) -> Report:
    """The :class:`Report` of a loihi2-sim / lava command: the runs' reports merged (an analog
    prefix's MACs on both sides of the energy), and the quantisation check over all their
    images (:func:`.fidelity.check`: rates at every step against the float network's, the
    weights flushed, the decisions)."""
    if not runs:
        return Report()
    extra = merge_runs(runs)
    if analog_macs_per_image and extra.get("energy"):
        extra["energy"] = with_analog_prefix(extra["energy"], analog_macs_per_image)
    counts: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    decisions = [0, 0]
    for r in runs:
        fid = r.extra.get("fidelity") or {}
        for mine, theirs in ((counts, fid.get("counts") or r.spikes), (floats, fid.get("float_counts"))):
            for k, v in (theirs or {}).items():
                v = torch.as_tensor(v, dtype=torch.float64).reshape(-1)
                mine[k] = mine[k] + v if k in mine else v
        if fid.get("decisions"):
            decisions = [a + b for a, b in zip(decisions, fid["decisions"])]
    images, T = sum(int(r.outputs.shape[1]) for r in runs), int(runs[0].outputs.shape[0])
    fid = check(q, counts, floats or None, images, T, (decisions[0], decisions[1]) if decisions[1] else None)
    record = {k: fid[k] for k in ("warnings", "lowest_rate_ratio", "decision_agreement", "tolerances", "layers")}
    record["flushed"] = {k: v["fraction"] for k, v in fid["connections"].items()}
    return Report(text=f"Loihi 2 ({name})\n" + format_report(extra),
                  verdict=("WARNING: " if fid["warnings"] else "") + summary(fid, name),
                  warnings=tuple(fid["warnings"]), record={"quantisation_check": record}, extra=extra)
