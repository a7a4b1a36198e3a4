"""Command line: ``snnconv demo``, ``check``, ``export`` (a saved network to NIR) and ``inspect``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _load_model(path: str, model_name: str | None, num_classes: int, in_channels: int,
                trust_pickle: bool):
    import torch

    from . import models
    from .errors import SnnconvError

    if model_name:
        model = models.get(model_name, num_classes=num_classes, in_channels=in_channels)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise SnnconvError(
                f"cannot read {path} as a state dict ({type(exc).__name__}: {exc}). A whole pickled "
                "module needs --trust-pickle (only for files you trust) and no --model.") from exc
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise SnnconvError(f"{path} does not fit model '{model_name}' (num_classes={num_classes}, "
                               f"in_channels={in_channels}): {exc}") from exc
        return model
    if not trust_pickle:
        raise SnnconvError(
            f"{path}: give --model NAME (one of {models.names()}) to load a state dict safely, or "
            "--trust-pickle to unpickle a whole saved module (this runs code from the file).")
    try:
        model = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise SnnconvError(f"cannot unpickle {path} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(model, torch.nn.Module):
        raise SnnconvError(f"{path} holds a {type(model).__name__}, not an nn.Module")
    return model


def _check(args) -> int:
    from . import models
    from .errors import BatchNormRemainsError, SnnconvError
    from .fold import fold_batchnorm
    from .guards import find_batchnorm

    targets = []
    try:
        if args.zoo:
            for name in models.names():
                targets.append((f"zoo:{name}", models.get(name, in_channels=args.in_channels,
                                                          num_classes=args.num_classes)))
        elif args.path:
            targets.append((args.path, _load_model(args.path, args.model, args.num_classes,
                                                   args.in_channels, args.trust_pickle)))
        else:
            print("snnconv check: give PATH (with --model NAME) or --zoo", file=sys.stderr)
            return 2
        failed = False
        for label, model in targets:
            if args.fold:
                model = fold_batchnorm(model)
            offenders = find_batchnorm(model)
            if offenders:
                failed = True
                print(f"FAIL {label}: {len(offenders)} BatchNorm(s) remain"
                      f"{' after folding' if args.fold else ''}:")
                for o in offenders:
                    print(f"  - {o}")
            else:
                print(f"ok   {label}: no BatchNorm{' after folding' if args.fold else ''}")
        return 1 if failed else 0
    except (SnnconvError, BatchNormRemainsError, FileNotFoundError) as exc:
        print(f"snnconv check: {exc}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _cmd_export(args) -> int:
    """``snnconv export NETWORK.pt OUT.nir``: a SpikingNetwork.save file to a NIR file."""
    import os

    from .errors import SnnconvError
    from .nir_io import export_nir, save_nir
    from .spiking import SpikingNetwork

    try:
        snn = SpikingNetwork.load(args.network)
        shape = None
        if args.input_shape:
            try:
                shape = tuple(int(v) for v in args.input_shape.split(","))
            except ValueError:
                raise SnnconvError(f"--input-shape {args.input_shape!r} is not like 3,32,32") from None
        graph = export_nir(snn, input_shape=shape)
        save_nir(graph, args.out)
    except (SnnconvError, OSError) as exc:
        print(f"snnconv export: {_one_line(exc)}", file=sys.stderr)
        return 2
    neurons = sum(1 for n in graph.nodes.values() if type(n).__name__ in ("I", "IF"))
    print(f"wrote {args.out}: {len(graph.nodes)} nodes, {len(graph.edges)} edges, {neurons} neuron "
          f"layers, reset={graph.metadata['reset']}, T={graph.metadata['T']}, "
          f"{os.path.getsize(args.out) / 1e6:.2f} MB")
    return 0


def _inspect_rows(graph) -> tuple[list[list[str]], dict[str, int]]:
    import numpy as np

    from snnconv_backends.nirgraph import parse

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
    import os

    from .errors import SnnconvError
    from .nir_io import load_nir

    try:
        graph = load_nir(args.file)
        rows, totals = _inspect_rows(graph)
    except (SnnconvError, OSError) as exc:
        print(f"snnconv inspect: {_one_line(exc)}", file=sys.stderr)
        return 2
    header = ["node", "type", "shape", "theta min / mean / max", "parameters"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    meta = {k: v for k, v in graph.metadata.items()}
    print(f"total: {totals['ops']} ops, {totals['neuron layers']} neuron layers "
          f"({totals['neurons']} neurons), {totals['parameters']} parameters; "
          f"reset={meta.get('reset')}, T={meta.get('T')}, producer={meta.get('producer')}, "
          f"{os.path.getsize(args.file) / 1e6:.2f} MB")
    return 0


# energy per operation, 45 nm CMOS, 32-bit float (Horowitz, "Computing's energy problem (and
# what we can do about it)", ISSCC 2014; the defaults of spikingjelly's SimpleEnergyProfiler):
# an accumulate (AC, one add) 0.9 pJ, a multiply-accumulate (MAC) 3.7 + 0.9 = 4.6 pJ
E_AC_PJ, E_MAC_PJ = 0.9, 4.6
_RUN_DATA = ("digits", "fashion_mnist", "cifar10")


def _run_dataset(name: str, root: str | None):
    from .data import cifar10, digits, fashion_mnist
    from .errors import DataError

    if name == "digits":
        return digits(seed=0)[1]
    if name == "fashion_mnist":
        return fashion_mnist(root, train=False)
    if name == "cifar10":
        if not root:
            raise DataError("--data cifar10 needs --data-root DIR (holding cifar-10-batches-py)")
        return cifar10(root, train=False)
    raise DataError(f"unknown --data {name!r}; choose one of {', '.join(_RUN_DATA)}")


def _backend_options(pairs: list[str]) -> dict:
    import json

    from .errors import BackendError

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


def _cmd_run(args) -> int:
    """``snnconv run FILE.nir --backend cpu --data digits --T 8``: accuracy, spikes, synops, energy."""
    import torch
    from torch.utils.data import DataLoader

    from . import backends
    from .errors import SnnconvError
    from .nir_io import load_nir

    try:
        graph = load_nir(args.file)
        program = backends.get(args.backend).compile(graph, **_backend_options(args.option))
        dataset = _run_dataset(args.data, args.data_root)
        if args.limit:
            dataset = torch.utils.data.Subset(dataset, range(min(args.limit, len(dataset))))
        T = args.T if args.T is not None else graph.metadata.get("T")
        if T is None:
            raise SnnconvError(f"{args.file} records no T; give --T")
        correct = torch.zeros(int(T), dtype=torch.float64)
        n, spikes, synops, macs, seconds = 0, {}, {}, {}, 0.0
        chip_runs = []  # loihi2-sim / lava: their quantisation, resources and energy reports
        for x, y in DataLoader(dataset, batch_size=args.batch):
            r = program.run(x, int(T))
            # accuracy of the readout averaged over the first t steps, t = 1..T
            mean_t = r.outputs.float().cpu().cumsum(0) / torch.arange(1, int(T) + 1).view(-1, 1, 1)
            correct += (mean_t.argmax(-1) == y.view(1, -1)).sum(1).double()
            n += len(y)
            seconds += float(r.extra.get("seconds", 0.0))
            for d, new in ((spikes, r.spikes), (synops, r.synops), (macs, r.macs)):
                for k, v in new.items():
                    d[k] = d[k] + v if k in d else v
            static = set(r.extra.get("static_ops", ()))
            if "quantisation" in r.extra:
                chip_runs.append(r)
    except (SnnconvError, OSError) as exc:
        print(f"snnconv run: {_one_line(exc)}", file=sys.stderr)
        return 2
    T = int(T)
    from snnconv_backends.nirgraph import parse

    sizes = {op.name: op.out_shape for op in parse(graph).ops if op.kind == "neuron"}
    print(f"{args.file} on backend '{args.backend}', {args.data} test set ({n} images), T={T}: "
          f"{seconds:.2f} s ({n * T / max(seconds, 1e-9):.0f} image-steps/s)")
    print(f"accuracy (mean readout over T={T}): {100 * correct[-1] / n:.2f}%")
    by_t = ", ".join(f"{t + 1}: {100 * c / n:.1f}" for t, c in enumerate(correct.tolist()))
    print(f"accuracy by t: {by_t}")
    print("\nspikes per neuron layer (rate = spikes per neuron per step)")
    rows = [["layer", "neurons", "spikes", "rate", "by step"]]
    for name, counts in spikes.items():
        units = int(torch.Size(sizes[name]).numel())
        rate = float(counts.sum()) / (units * n * T)
        rows.append([name, str(units), f"{float(counts.sum()):.0f}", f"{rate:.4f}",
                     " ".join(f"{float(c) / (units * n):.3f}" for c in counts)])
    _print_table(rows)
    print("\nsynaptic operations (accumulates, per image over T steps) vs the ANN's MACs (per image)")
    rows = [["layer", "SNN AC", "ANN MAC", "AC / MAC"]]
    e_snn = 0.0
    for name, m in macs.items():
        ac = synops.get(name)
        if ac is None:  # not fed by spikes: dense MACs, once for a static layer, else every step
            e_snn += m / n * (1 if name in static else T) * E_MAC_PJ
            rows.append([name, "(dense: " + ("once" if name in static else f"x{T}") + ")",
                         f"{m / n:.4g}", ""])
        else:
            e_snn += ac / n * E_AC_PJ
            rows.append([name, f"{ac / n:.4g}", f"{m / n:.4g}", f"{ac / m:.3f}"])
    for name, ac in synops.items():
        if name not in macs:  # an identity-shortcut Scale: one add per spike
            e_snn += ac / n * E_AC_PJ
            rows.append([name, f"{ac / n:.4g}", "0", ""])
    tot_ac, tot_mac = sum(synops.values()) / n, sum(macs.values()) / n
    rows.append(["total", f"{tot_ac:.4g}", f"{tot_mac:.4g}", f"{tot_ac / max(tot_mac, 1e-9):.3f}"])
    _print_table(rows)
    e_ann = tot_mac * E_MAC_PJ
    print(f"\nenergy estimate per image (synaptic arithmetic only; neuron updates and memory "
          f"traffic not counted): SNN {e_snn / 1e6:.3f} uJ vs ANN {e_ann / 1e6:.3f} uJ "
          f"({e_snn / max(e_ann, 1e-12):.2f}x), at {E_AC_PJ} pJ per AC and {E_MAC_PJ} pJ per MAC "
          "(45 nm, 32-bit float; Horowitz, ISSCC 2014, as spikingjelly's SimpleEnergyProfiler)")
    if chip_runs:
        from snnconv_backends.loihi2 import format_report

        print("\nLoihi 2 (" + args.backend + ")\n" + format_report(chip_runs))
    return 0


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _cmd_backends(args) -> int:
    """``snnconv backends``: every installed backend, usable or not, and why not."""
    from . import backends

    rows = [["backend", "usable", "why not"]]
    for name, (ok, reason) in backends.available().items():
        rows.append([name, "yes" if ok else "no", reason])
    _print_table(rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snnconv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small BN CNN on scikit-learn digits and convert it")
    demo.add_argument("--out", default="runs/demo", help="folder for meta.json and the plot")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    check = sub.add_parser("check", help="exit non-zero (listing them) when BatchNorm remains")
    check.add_argument("path", nargs="?", help="a saved state dict (with --model) or module")
    check.add_argument("--model", help="zoo model name the state dict belongs to")
    check.add_argument("--num-classes", type=int, default=10)
    check.add_argument("--in-channels", type=int, default=3)
    check.add_argument("--fold", action="store_true", help="fold BatchNorm first, then check")
    check.add_argument("--zoo", action="store_true", help="check every zoo model")
    check.add_argument("--trust-pickle", action="store_true",
                       help="allow unpickling a whole saved module (runs code from the file)")

    export = sub.add_parser("export", help="write a saved SpikingNetwork (NETWORK.pt) as a NIR file",
                            description="example: snnconv export runs/net.pt runs/net.nir")
    export.add_argument("network", help="a file written by SpikingNetwork.save")
    export.add_argument("out", help="the NIR (HDF5) file to write")
    export.add_argument("--input-shape", help="batch-free input shape, e.g. 3,32,32 (default: the "
                        "shape recorded at conversion)")

    inspect = sub.add_parser("inspect", help="list the nodes of a NIR file (type, shape, thresholds)",
                             description="example: snnconv inspect runs/net.nir")
    inspect.add_argument("file", help="a NIR (HDF5) file")

    run = sub.add_parser("run", help="run a NIR file on a backend: accuracy, spikes, synops, energy",
                         description="example: snnconv run runs/net.nir --backend cpu --data digits --T 8")
    run.add_argument("file", help="a NIR (HDF5) file")
    run.add_argument("--backend", default="cpu", help="cpu, gpu, ... (see: snnconv backends)")
    run.add_argument("--data", default="digits", choices=_RUN_DATA, help="test set to evaluate on")
    run.add_argument("--data-root", help="dataset folder (Fashion-MNIST IDX files, CIFAR-10)")
    run.add_argument("--T", type=int, help="time steps (default: the T recorded in the file)")
    run.add_argument("--batch", type=int, default=256)
    run.add_argument("--limit", type=int, default=0, help="first N test images only")
    run.add_argument("--option", action="append", metavar="KEY=VALUE",
                     help="a backend option, e.g. --option dtype=float64 (repeatable)")

    sub.add_parser("backends", help="list the installed backends and why one is unavailable")

    args = parser.parse_args(argv)
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "backends":
        return _cmd_backends(args)
    if args.command == "export":
        return _cmd_export(args)
    if args.command == "inspect":
        return _cmd_inspect(args)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.out, seed=args.seed, progress=not args.quiet)
        return 0
    return _check(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
