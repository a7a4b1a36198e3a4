"""Command line: ``snnconv demo`` and ``snnconv check``."""

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

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.out, seed=args.seed, progress=not args.quiet)
        return 0
    return _check(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
