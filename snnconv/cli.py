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

    args = parser.parse_args(argv)
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
