"""``snnconv check``: exit 1, listing them, when BatchNorm remains in a model (a CI guard)."""

from __future__ import annotations

from snnconv.cli.common import UsageError, add_command, load_model

__all__ = ["add_check"]


def _cmd_check(args) -> int:
    from snnconv import models
    from snnconv.guards import find_batchnorm
    from snnconv.stages.fold import fold_batchnorm

    in_channels = args.in_channels or 3
    classes = args.num_classes or 10
    fold = args.fold or args.zoo  # the zoo's models hold BatchNorm by design: convert folds it
    after = " after folding" if fold else ""
    targets = []
    if args.zoo:
        print(f"the zoo (--model NAME; built here for {in_channels} input channels, {classes} classes), "
              "each checked as convert sees it, after folding BatchNorm:")
        for name in models.names():
            targets.append((f"zoo:{name}", models.get(name, in_channels=in_channels, num_classes=classes)))
    elif args.path:
        targets.append((args.path, load_model(args.path, args.model, classes,
                                              in_channels, args.trust_pickle, pickle_flag=True)))
    else:
        raise UsageError("give PATH (with --model NAME) or --zoo")
    failed = False
    for label, model in targets:
        size = f" ({sum(p.numel() for p in model.parameters()):,} parameters)" if args.zoo else ""
        if fold:
            model = fold_batchnorm(model)
        offenders = find_batchnorm(model)
        if offenders:
            failed = True
            print(f"FAIL {label}{size}: {len(offenders)} BatchNorm(s) remain{after}:")
            for o in offenders:
                print(f"  - {o}")
        else:
            print(f"ok   {label}{size}: no BatchNorm{after}")
    return 1 if failed else 0


def add_check(sub, pa: dict) -> None:
    p = add_command(sub, "check", "exit 1 (listing them) when BatchNorm remains in a model",
                    "snnconv check model_state.pt --model resnet18 --fold", [pa["common"], pa["model"]],
                    _cmd_check)
    p.add_argument("path", nargs="?", help="a saved state dict (with --model) or module")
    p.add_argument("--fold", action="store_true", help="fold BatchNorm first, then check")
    p.add_argument("--zoo", action="store_true",
                   help="list the zoo's models and check each after folding (as convert sees them)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling a whole saved module (runs code from the file)")
