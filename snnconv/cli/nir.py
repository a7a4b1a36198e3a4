"""``snnconv export``, ``inspect``, ``run`` and ``backends``: an SNN as a NIR file, and the file on
a backend (accuracy, spikes, synaptic operations, energy)."""

from __future__ import annotations

import json
import os
import time
import warnings
from types import SimpleNamespace
from typing import Any

from snnconv.analysis.energy import arithmetic_energy, format_arithmetic
from snnconv.cli.common import (
    Heartbeat,
    UsageError,
    add_command,
    datasets,
    few_images,
    load_snn,
    nir_path,
    positive_float,
    positive_int,
    subset_record,
    write_json,
)

__all__ = ["add_export", "add_inspect", "add_run", "add_backends", "record_name", "rate_text"]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _cmd_export(args) -> int:
    """``snnconv export NETWORK.pt OUT.nir``: a SpikingNetwork.save file to a NIR file."""
    from snnconv.snn.nir_io import export_nir, save_nir
    from snnconv.snn.prefixfile import save_prefix

    snn, args.network = load_snn(args, args.network)
    args.out = args.nir_out or args.out or os.path.join(os.path.dirname(args.network), "snn.nir")
    shape = None
    if args.input_shape:
        try:
            shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise UsageError(f"--input-shape {args.input_shape!r} is not like 3,32,32") from None
    graph = export_nir(snn, input_shape=shape)
    prefix = save_prefix(snn, graph, args.out)
    save_nir(graph, args.out)
    neurons = sum(1 for n in graph.nodes.values() if type(n).__name__ in ("I", "IF"))
    print(f"wrote {args.out}: {len(graph.nodes)} nodes, {len(graph.edges)} edges, {neurons} neuron "
          f"layers, reset={graph.metadata['reset']}, T={graph.metadata['T']}, "
          f"{os.path.getsize(args.out) / 1e6:.2f} MB")
    if prefix:
        print(f"wrote {prefix}: the analog prefix (runs once per image; its output is the graph's input)")
    return 0


def _inspect_rows(graph) -> tuple[list[list[str]], dict[str, int]]:
    import numpy as np

    from snnconv.nir.reader import parse

    parsed = parse(graph)
    rows, totals = [], {"ops": 0, "neuron layers": 0, "neurons": 0, "parameters": 0}
    for op in parsed.ops:
        node = graph.nodes[op.name]
        kind = type(node).__name__
        theta, count = "", 0
        if op.kind == "neuron":
            t = np.asarray(op.params["theta"], dtype=np.float64)
            theta = f"{t.min():.4g} / {t.mean():.4g} / {t.max():.4g}"
            kind = "IF (reset zero)" if kind == "IF" else "I+Threshold+Scale (subtract)"
            count = t.size
            totals["neuron layers"] += 1
            totals["neurons"] += int(np.prod(op.out_shape))
        elif op.kind == "sum":
            kind = "sum"
        else:
            count = sum(int(np.asarray(op.params[k]).size) for k in ("weight", "bias") if k in op.params)
            if op.kind == "scale":
                count = int(np.unique(np.asarray(op.params["scale"])).size)
        if op.kind == "avgpool2d" and op.params["adaptive"]:
            kind += " (adaptive)"
        totals["ops"] += 1
        totals["parameters"] += count
        rows.append([op.name, kind, "x".join(map(str, op.out_shape)), theta, str(count) if count else ""])
    return rows, totals


def _cmd_inspect(args) -> int:
    """``snnconv inspect FILE.nir``: one row per op (node, type, shape, thresholds, parameters)."""
    from snnconv.nir.format import ANALOG_PREFIX, INPUT_KEY, PREFIX_FILE_KEY
    from snnconv.snn.nir_io import load_nir

    args.file = nir_path(args.file)
    graph = load_nir(args.file)
    rows, totals = _inspect_rows(graph)
    _print_table([["node", "type", "shape", "theta min / mean / max", "parameters"]] + rows)
    meta = {k: v for k, v in graph.metadata.items()}
    print(f"total: {totals['ops']} ops, {totals['neuron layers']} neuron layers "
          f"({totals['neurons']} neurons), {totals['parameters']} parameters; "
          f"reset={meta.get('reset')}, T={meta.get('T')}, producer={meta.get('producer')}, "
          f"{os.path.getsize(args.file) / 1e6:.2f} MB")
    if meta.get(INPUT_KEY) == ANALOG_PREFIX:
        print(f"input: the output of the analog prefix in {meta.get(PREFIX_FILE_KEY)} (run once per "
              "image; snnconv run applies it)")
    return 0


def _check_images(args, shape, graph, prefix) -> None:
    """UsageError unless the images of ``--data`` have the shape the network takes (the analog
    prefix's input where there is one, else the graph's), naming both and what to give."""
    from snnconv.nir.reader import parse

    recorded = (prefix.meta or {}).get("input_shape") if prefix is not None else None
    want = tuple(recorded) if recorded else tuple(parse(graph, dt=args.dt).input_shape)
    got = tuple(int(v) for v in shape)
    if got == want or len(want) != 3 or len(got) != 3:
        return
    advice = []
    if got[0] != want[0]:
        advice.append(f"images with {want[0]} channel(s), not {got[0]}")
    if got[1:] != want[1:]:
        size = f"{want[1]}" if want[1] == want[2] else f"{want[1]}x{want[2]}"
        advice.append(f"give --image-size {size}" if os.path.isdir(args.data) and want[1] == want[2]
                      else f"images of {size} px")
    raise UsageError(f"the images of --data {args.data} are {got[1]}x{got[2]} px with {got[0]} channel(s); the "
                     f"network was converted for {want[1]}x{want[2]} px with {want[0]} channel(s): "
                     + "; ".join(advice) + " (--data: the data it was converted on)")


def _run_dataset(args):
    """The test split of ``--data`` (digits and synthetic: the split of seed 0; a folder: its test
    split), cut to ``--limit`` images."""
    import argparse

    return datasets(argparse.Namespace(**{**vars(args), "seed": 0}))[1]


def record_name(rec: dict, data: str, settings: dict) -> str:
    """``backends/``'s file name for one run: backend, T, data and images, and a digest of the
    other settings where there are any (``cpu_T4_digits_128img.json``): a run with another T,
    data, image count or option is written beside the others, never over them."""
    import hashlib

    def clean(text: str) -> str:
        return "".join(c if c.isalnum() or c in "-." else "-" for c in text).strip("-.") or "data"

    name = f"{clean(rec['backend'])}_T{rec['T']}_{clean(os.path.basename(os.path.normpath(data)))}_{rec['images']}img"
    if settings:
        name += "_" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return name + ".json"


def _backend_options(pairs: list[str]) -> dict:
    from snnconv.errors import BackendError

    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BackendError(f"--option {pair!r} is not KEY=VALUE (e.g. dtype=float64)")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


#: Images per backend call where ``--batch`` is not given: Lava runs one process per Lava
#: process and reads its monitors value by value, so its batches stay small (a progress line
#: and an estimate after each).
DEFAULT_BATCH = 256


def _cmd_run(args) -> int:
    """``snnconv run FILE.nir --backend cpu --data digits --T 8``: accuracy, spikes, synops, energy.

    Also writes ``OUT/backends/BACKEND_T<T>_<DATA>_<N>img[_<digest>].json`` (default OUT: the
    NIR file's folder; :func:`record_name`) for ``snnconv report``: accuracy, agreement with the torch network
    read from the same file,
    operation counts, energy and the backend's own report.
    """
    import torch
    from torch.utils.data import DataLoader

    from snnconv import backends
    from snnconv.analysis.activity import static_macs
    from snnconv.backends import RunWarning
    from snnconv.errors import SnnconvError
    from snnconv.snn.nir_io import from_nir, load_nir
    from snnconv.snn.prefixfile import load_prefix

    args.file = nir_path(args.file)
    graph = load_nir(args.file, dt=args.dt)
    prefix = load_prefix(graph, args.file, args.prefix)
    program = backends.get(args.backend).compile(graph, dt=args.dt, **_backend_options(args.option))
    dataset = _run_dataset(args)
    if len(dataset) == 0:
        raise SnnconvError(f"the {args.data} test set holds no images")
    _check_images(args, dataset[0][0].shape, graph, prefix)
    T = args.T if args.T is not None else graph.metadata.get("T")
    if T is None:
        raise UsageError(f"{args.file} records no T; give --T")
    T = int(T)
    rule = _exit_rule(args, graph)
    exits: list = []  # per batch: (each image's exit step, its answer)
    correct = torch.zeros(T, dtype=torch.float64)
    reference = from_nir(graph, dt=args.dt)
    refs, outputs, labels, extra, t_start = [], [], [], {}, time.perf_counter()
    n, seconds = 0, 0.0
    spikes: dict[str, Any] = {}
    synops: dict[str, Any] = {}
    macs: dict[str, Any] = {}
    prefix_macs: dict[str, float] = {}
    runs = []  # every batch's run: what the backend reports on them (Program.report)
    batch = args.batch or program.default_batch or DEFAULT_BATCH
    with Heartbeat(f"snnconv run ({args.backend})", len(dataset), quiet=args.quiet) as beat:
        for x, y in DataLoader(dataset, batch_size=batch):
            if prefix is not None:  # the static analog prefix, once per image
                for k, v in static_macs(prefix, x).items():  # its MACs, on both sides
                    prefix_macs[k] = prefix_macs.get(k, 0.0) + v
                with torch.no_grad():
                    x = prefix(x)
            with warnings.catch_warnings():  # judged once, on every image, by the backend's report
                warnings.simplefilter("ignore", RunWarning)
                r = program.run(x, T) if rule is None else _run_exit(program, x, T, rule, args.backend)
            if rule is not None:
                exits.append(_exits(r, rule))
            readout = r.outputs if rule is None else _held(r.outputs, exits[-1][0], exits[-1][1])
            # accuracy of the readout averaged over the first t steps, t = 1..T
            mean_t = readout.float().cpu().cumsum(0) / torch.arange(1, T + 1).view(-1, 1, 1)
            correct += (mean_t.argmax(-1) == y.view(1, -1)).sum(1).double()
            n += len(y)
            seconds += float(r.extra.get("seconds", 0.0))
            for d, new in ((spikes, r.spikes), (synops, r.synops), (macs, r.macs)):
                for key, value in new.items():
                    d[key] = d[key] + value if key in d else value
            static = set(r.extra.get("static_ops", ()))
            runs.append(r)
            with torch.no_grad():  # the torch network read back from the same file: the reference
                refs.append(reference.run(x, T=T).mean(0).argmax(1))
            outputs.append(readout.float().cpu())
            labels.append(y)
            extra = dict(r.extra or {})
            beat.update(len(y))
    timed = seconds if seconds > 0 else time.perf_counter() - t_start  # the backend's own time, else wall
    print(f"{args.file} on backend '{args.backend}', {args.data} test set ({n} images), T={T}: "
          f"{timed:.2f} s ({rate_text(n * T, timed)})")
    held = "" if rule is None else ", each image's readout held at its answer after its exit"
    print(f"accuracy (mean readout over T={T}{held}): {100 * correct[-1] / n:.2f}%")
    by_t = ", ".join(f"{t + 1}: {100 * c / n:.1f}" for t, c in enumerate(correct.tolist()))
    print(f"accuracy by t{held}: {by_t}")
    early = None if rule is None else _exit_record(rule, exits, torch.cat(labels), T, args.backend)
    if not args.quiet:  # --quiet: no tables
        _print_spikes(spikes, graph, args.dt, n, T)
    energy = _print_synops(synops, macs, static, prefix_macs, n, T, quiet=args.quiet)
    print("\n" + format_arithmetic(energy))
    report = program.report(runs, analog_macs_per_image=sum(prefix_macs.values()) / n)
    if report.extra is not None:
        extra = dict(report.extra)  # every batch's, not the last one's
    if report.text and not args.quiet:
        print("\n" + report.text)
    if report.verdict:  # said once, on stdout beside the results (--strict: exit 1 on a warning)
        print(report.verdict)
    from snnconv.analysis.activity import backend_record

    # the batches as one RunResult-like record
    merged = SimpleNamespace(outputs=torch.cat(outputs, 1), synops=synops, macs=macs, extra=extra)
    rec = backend_record(args.backend, merged, torch.cat(labels), torch.cat(refs), T=T,
                         wall_s=time.perf_counter() - t_start)
    rec.update(report.record)
    rec["energy_45nm_per_image_nj"] = {"snn": energy["snn_pj"] / 1e3, "ann": energy["ann_pj"] / 1e3,
                                       "snn_over_ann": energy["ratio"]}
    rec["energy"] = energy
    if early is not None:
        rec["early_exit"] = early
    settings = _settings(args, rule)
    rec.update(data=args.data, settings=settings, file=os.path.basename(args.file))
    subset = subset_record(dataset)
    if subset is not None:
        rec["test_subset"] = subset
    few_images(args, n)
    out = args.out or os.path.dirname(os.path.abspath(args.file))
    path = os.path.join(out, "backends", record_name(rec, args.data, settings))
    before = _accuracy_in(path)
    write_json(path, rec)
    print(f"\nagreement with the torch network read from the same file: {rec['agreement']:.2f}%; "
          f"wrote {path}" + (f" (it replaces an earlier run of the same backend, T, data, images and "
                             f"settings: {before})" if before else ""))
    if args.strict and report.warnings:
        print(f"--strict: the {args.backend} backend's check failed ({len(report.warnings)} departure(s))")
        return 1
    return 0


def _print_spikes(spikes: dict, graph: Any, dt: float, n: int, T: int) -> None:
    """The spikes per neuron layer: count, rate, and rate at each step."""
    import torch

    from snnconv.nir.reader import parse

    sizes = {op.name: op.out_shape for op in parse(graph, dt=dt).ops if op.kind == "neuron"}
    print("\nspikes per neuron layer (rate = spikes per neuron per step)")
    rows = [["layer", "neurons", "spikes", "rate", "by step"]]
    for name, counts in spikes.items():
        units = int(torch.Size(sizes[name]).numel())
        rate = float(counts.sum()) / (units * n * T)
        rows.append([name, str(units), f"{float(counts.sum()):.0f}", f"{rate:.4f}",
                     " ".join(f"{float(c) / (units * n):.3f}" for c in counts)])
    _print_table(rows)


def _settings(args, rule) -> dict:
    """What else changes a run's result: recorded, and a part of its file name where set."""
    return {k: v for k, v, unset in (("option", _backend_options(args.option), {}), ("dt", args.dt, 1.0),
                                     ("image_size", args.image_size, None),
                                     ("early_exit", rule.to_dict() if rule is not None else None, None))
            if v != unset}


def _exit_rule(args, graph):
    """The early-exit rule stored in the file, where ``--early-exit`` asks for it."""
    if not args.early_exit:
        return None
    from snnconv.exit_rule import stored_rule

    rule = stored_rule(graph.metadata)
    if rule is None:
        raise UsageError(f"{args.file} stores no early-exit rule: calibrate one (snnconv calibrate-exit RUN), "
                         "export the network again (snnconv export), or run without --early-exit")
    return rule


def _run_exit(program, x, T: int, rule, backend: str):
    """``program.run`` with the rule; a backend whose ``run`` takes none runs all T steps and
    the rule is applied to its readout."""
    import inspect

    from snnconv_backends.registry import readout_exit

    if "exit_rule" in inspect.signature(program.run).parameters:
        return program.run(x, T, exit_rule=rule)
    return readout_exit(program.run(x, T), rule, backend)


def _exits(r, rule) -> tuple:
    """``(exit steps [B], answers [B, ...], how the work was counted)`` of one run (its
    ``extra["early_exit"]``): ``"dropped"`` (exited images left the batch), ``"to exit"`` (all T
    simulated, the work counted to each exit) or ``"all T"``."""
    e = r.extra["early_exit"]
    how = "dropped" if e.get("dropped") else e.get("counted", "all T")
    return e["steps"].cpu(), e["output"].float().cpu(), how


def _held(outputs, steps, answers):
    """Per-step readouts ``[T, B, ...]`` with each image's readout after its exit step set to its
    answer, so that the running mean stays at the answer (the engine's own convention)."""
    import torch

    out = outputs.float().cpu().clone()
    after = torch.arange(out.shape[0]).view(-1, 1) >= steps.view(1, -1)  # [T, B]
    out[after] = answers.unsqueeze(0).expand_as(out)[after]
    return out


def _exit_record(rule, exits: list, labels, T: int, backend: str) -> dict:
    """``run``'s early-exit record (printed): accuracy, mean steps and the exit steps' histogram."""
    import torch

    from snnconv.exit_rule import exit_histogram

    steps = torch.cat([s for s, _, _ in exits])
    answers = torch.cat([a for _, a, _ in exits])
    acc = 100.0 * float((answers.reshape(len(steps), -1).argmax(1) == labels).double().mean())
    counted = {c for _, _, c in exits}
    counted_as = counted.pop() if len(counted) == 1 else "all T"
    dropped = counted_as == "dropped"
    how = {"dropped": "exited images left the batch: the spikes, operations and energy above count the "
                      "steps each image ran",
           "to exit": f"{backend} simulated all T={T} steps; the spikes, operations and energy above count "
                      "each image's steps up to its exit",
           }.get(counted_as, f"{backend} ran all T={T} steps; the rule was applied to its readout (the spikes, "
                             "operations and energy above are those of all T steps)")
    print(f"early exit ({rule.kind} >= {rule.threshold:g}, from step {rule.min_steps}): {acc:.2f}% at a mean of "
          f"{float(steps.double().mean()):.2f} of {T} steps; {how}")
    return {"rule": rule.to_dict(), "accuracy": acc, "mean_steps": float(steps.double().mean()),
            "histogram": exit_histogram(steps, T), "dropped": dropped, "counted": counted_as}


def rate_text(image_steps: int, seconds: float) -> str:
    """``"25,600 image-steps/s"``, ``"0.4 image-steps/s"``: three significant digits below 100."""
    rate = image_steps / max(seconds, 1e-9)
    return f"{rate:,.0f} image-steps/s" if rate >= 100 else f"{rate:.3g} image-steps/s"


def _accuracy_in(path: str) -> str | None:
    """``"accuracy 97.66%"`` of the backend record at ``path``; None where there is none."""
    try:
        with open(path, encoding="utf-8") as fh:
            return f"accuracy {json.load(fh)['accuracy']:.2f}%"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _print_synops(synops: dict, macs: dict, static: set, prefix_macs: dict, n: int, T: int,
                  quiet: bool = False) -> dict:
    """The synaptic operations table (per image; none with ``quiet``); returns the arithmetic
    comparison (:func:`snnconv.analysis.energy.arithmetic_energy`) of the run."""
    if not quiet:
        print("\nsynaptic operations (accumulates, per image over T steps) vs the ANN's MACs (per image)")
    rows = [["layer", "SNN AC", "ANN MAC", "AC / MAC"]]
    analog = 0.0
    for name, m in prefix_macs.items():
        analog += m
        rows.append([f"(analog prefix) {name}", "(dense: once)", f"{m / n:.4g}", ""])
    for name, m in macs.items():
        ac = synops.get(name)
        if ac is None:  # not fed by spikes: dense MACs, once for a static layer, else every step
            analog += m * (1 if name in static else T)
            rows.append([name, "(dense: " + ("once" if name in static else f"x{T}") + ")",
                         f"{m / n:.4g}", ""])
        else:
            rows.append([name, f"{ac / n:.4g}", f"{m / n:.4g}", f"{ac / m:.3f}"])
    for name, ac in synops.items():
        if name not in macs:  # an identity-shortcut Scale: one add per spike
            rows.append([name, f"{ac / n:.4g}", "0", ""])
    ann = sum(macs.values()) + sum(prefix_macs.values())
    tot_ac = sum(synops.values()) / n
    rows.append(["total", f"{tot_ac:.4g}", f"{ann / n:.4g}", f"{tot_ac * n / max(ann, 1e-9):.3f}"])
    if not quiet:
        _print_table(rows)
    return arithmetic_energy(synops=sum(synops.values()), analog_macs=analog, ann_macs=ann, images=n)


def _cmd_backends(args) -> int:
    """``snnconv backends``: every installed backend, usable or not, and why not."""
    from snnconv import backends

    rows = [["backend", "usable", "why not"]]
    for name, (ok, reason) in backends.available().items():
        rows.append([name, "yes" if ok else "no", reason])
    _print_table(rows)
    return 0


# --- the parsers ----------------------------------------------------------------------------

def add_export(sub, pa: dict) -> None:
    p = add_command(sub, "export", "write an SNN as a NIR graph file (HDF5)",
                    "snnconv export runs/d/snn.pt runs/d/snn.nir", [pa["common"]], _cmd_export)
    p.add_argument("network", help="a saved SNN (snn.pt, SpikingNetwork.save) or a run folder")
    p.add_argument("nir_out", nargs="?", help="the NIR file to write (default: --out, or snn.nir "
                   "beside the network)")
    p.add_argument("--input-shape", help="batch-free input shape, e.g. 3,32,32 (default: recorded "
                   "by convert)")


def add_inspect(sub, pa: dict) -> None:
    p = add_command(sub, "inspect", "print the nodes, shapes, thresholds and metadata of a NIR file",
                    "snnconv inspect runs/d/snn.nir", [pa["common"]], _cmd_inspect)
    p.add_argument("file", help="a NIR (HDF5) file, or a run folder holding snn.nir")


def add_run(sub, pa: dict) -> None:
    p = add_command(sub, "run", "run a NIR file on a backend: accuracy, spikes, synops, energy",
                    "snnconv run runs/d/snn.nir --backend loihi2-sim --data digits --T 8",
                    [pa["common"], pa["test_data"]], _cmd_run)
    p.add_argument("file", help="a NIR (HDF5) file, or a run folder holding snn.nir")
    p.add_argument("--backend", default="cpu", help="cpu, gpu, loihi2-sim, lava (see: snnconv backends)")
    # one T, not the shared --T's list: the run reports the accuracy at every t = 1..T
    p.add_argument("--T", type=positive_int, help="time steps (default: the T recorded in the file)")
    p.add_argument("--batch", type=positive_int,
                   help=f"images per backend call (default {DEFAULT_BATCH}, or the backend's own: lava 16). "
                        "A run longer than a few seconds prints progress on stderr (--quiet: none)")
    p.add_argument("--prefix", help="the analog prefix's network file, where the graph reads one "
                   "(default: the file its metadata names, beside the NIR file)")
    p.add_argument("--dt", type=positive_float, default=1.0,
                   help="the time step the file is read at (default 1; a neuron integrates r * dt "
                        "of its input per step, which must be 1: --dt 1e-4 for r = 1e4)")
    p.add_argument("--early-exit", action="store_true",
                   help="each image stops at the step where the early-exit rule stored in the file is met "
                        "(cpu and gpu drop it from the batch; the chip backends run all T and apply the "
                        "rule to their readout)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a quantised backend (loihi2-sim, lava) departs from the float "
                        "network beyond its stated tolerances (a layer's firing rate, weights flushed)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="a backend option, e.g. --option dtype=float64 (repeatable)")


def add_backends(sub, pa: dict) -> None:
    add_command(sub, "backends", "list the installed backends and why one is unavailable",
                "snnconv backends", [pa["common"]], _cmd_backends)
