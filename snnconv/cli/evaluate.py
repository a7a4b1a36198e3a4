"""``snnconv evaluate``, ``snnconv calibrate-exit`` and ``snnconv report``: what a saved SNN does
(at fixed T, and with early exit), and a run folder as a page."""

from __future__ import annotations

import json
import os

from snnconv.analysis.energy import format_arithmetic
from snnconv.cli.common import (
    UsageError,
    add_command,
    evaluation,
    load_model,
    load_snn,
    loaders,
    num_classes,
    positive_int,
    print_accuracy,
    recorded,
    say,
    time_steps,
    write_json,
)

__all__ = ["add_evaluate", "add_calibrate_exit", "add_report", "add_diagnose"]


def _recorded(path: str) -> str:
    """``"snn.pt at T=1, 2, 4 on 449 images"``: what the evaluation.json at ``path`` measured."""
    try:
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        Ts = ", ".join(sorted(old.get("accuracy", {}), key=int))
        return f"{old.get('network', 'a network')} at T={Ts} on {old.get('images', 'an unrecorded number of')} images"
    except (OSError, ValueError, AttributeError, TypeError):
        return "an earlier record"


def _held_out(args, train):
    """The images early exit is calibrated on: the split of the training data that fine-tuning
    holds out of its training (never the test split that ``evaluate`` reports)."""
    from snnconv.data import split_loader
    from snnconv.stages.finetune import FinetuneConfig

    return split_loader(train, FinetuneConfig().val_fraction, seed=args.seed)[1]


def _early_exit(args, snn, train, test, T: int, fixed: float) -> dict:
    """``evaluation.json``'s ``early_exit``: the network with early exit at most ``T`` steps on
    the test images, with the rule stored in the network, or one calibrated here (not stored)
    where none is stored or ``--exit-tolerance`` asks for it."""
    from snnconv.analysis.early_exit import calibrate_exit, evaluate_exit, observe_exits
    from snnconv.exit_rule import DEFAULT_TOLERANCE, META_KEY, stored_rule

    rule = stored_rule(snn.meta)
    if rule is None or args.exit_tolerance is not None:
        tolerance = DEFAULT_TOLERANCE if args.exit_tolerance is None else args.exit_tolerance
        why = "no early-exit rule is stored with this network" if rule is None else "--exit-tolerance"
        held = _held_out(args, train)
        if held is None:
            raise UsageError("early exit needs a rule: none is stored with this network and the training data is "
                             "too small to hold images out for its calibration; run snnconv calibrate-exit first")
        rec = calibrate_exit(snn, held, T=T, tolerance=tolerance, device=args.device, store=False)
        calibration = dict(rec.to_dict(), data=args.data, stored=False)
        rule = rec.rule
        say(args, f"early exit: {why}; calibrated on {rec.images:,} held-out training images (tolerance "
                  f"{tolerance:g} points): {rule.describe()}. Not stored: snnconv calibrate-exit stores it")
    else:
        calibration = dict(snn.meta[META_KEY], stored=True)
    res = evaluate_exit(snn, test, rule, T=T, device=args.device, progress=not args.quiet)
    # the rule's curve on the test images (every threshold of its kind) and the truncated runs
    seen = observe_exits(snn, test, T=T, device=args.device, progress=not args.quiet)
    return dict(res.to_dict(), accuracy_fixed_T=fixed, calibration=calibration,
                curve=seen.curve(rule.kind, rule.min_steps).to_dict(points=200),
                accuracy_by_step=seen.accuracy_by_step())


def _cmd_evaluate(args) -> int:
    from snnconv.exit_rule import ExitRule, stored_rule

    snn, src = load_snn(args, args.snn)
    snn = snn.to(args.device)
    Ts = time_steps(args)
    train, test = loaders(args)
    ev = evaluation(args, snn, test, Ts, os.path.basename(src))
    if isinstance(snn.meta, dict) and snn.meta.get("calibrated_T"):
        ev["calibrated_T"] = snn.meta["calibrated_T"]
    if args.early_exit or args.exit_tolerance is not None or stored_rule(snn.meta) is not None:
        ev["early_exit"] = _early_exit(args, snn, train, test, max(Ts), ev["accuracy"][str(max(Ts))])
    out = args.out or os.path.dirname(src) or "."
    path = os.path.join(out, "evaluation.json")
    before = _recorded(path) if os.path.exists(path) else None
    write_json(path, ev)
    print_accuracy(args, [(f"SNN T={t}", ev["accuracy"][str(t)]) for t in Ts], images=ev["images"])
    calibrated = snn.meta.get("calibrated_T") if isinstance(snn.meta, dict) else None
    if calibrated and any(t != calibrated for t in Ts):
        say(args, f"(this network was calibrated for T={calibrated}; at other T it runs the same network for "
                  "more or fewer steps, not a conversion made for that T)")
    if "early_exit" in ev:
        e = ev["early_exit"]
        say(args, f"{'SNN early exit':28}{e['accuracy']:6.2f}   at a mean of {e['mean_steps']:.2f} of {e['T']} steps "
                  f"({ExitRule.from_dict(e['rule']).describe()}); images stopping at step 1..{e['T']}: "
                  f"{e['histogram']}")
        if e["calibration"].get("T") not in (None, e["T"]):
            say(args, f"(the rule was calibrated at T={e['calibration']['T']}; here no image runs more than "
                      f"T={e['T']} steps)")
    rates = ev["analysis"]["firing_rate"]
    e = ev["analysis"]["energy"]
    say(args, f"mean firing rate {100 * sum(rates.values()) / max(1, len(rates)):.2f}% per step "
              f"(the first {ev['analysis']['batch']} test images at T={ev['analysis']['T']})")
    say(args, format_arithmetic(e))
    # the one line --quiet keeps: where the result went, and what it replaced
    print(f"wrote {path}: {_recorded(path)}" + (f" (it replaces {before})" if before else ""))
    return 0


def _cmd_calibrate_exit(args) -> int:
    from snnconv.analysis.early_exit import calibrate_exit
    from snnconv.exit_rule import META_KEY

    snn, src = load_snn(args, args.snn)
    snn = snn.to(args.device)
    T = args.T or snn.T
    train, _ = loaders(args)
    held = _held_out(args, train)
    if held is None:
        raise UsageError(f"the training data of --data {args.data} is too small to hold images out for the "
                         "calibration; give more (--train-limit) or another --data")
    say(args, f"calibrating early exit ({args.rule}, at most T={T} steps, tolerance {args.tolerance:g} points) on "
              "the held-out split of the training data ...")
    rec = calibrate_exit(snn, held, T=T, tolerance=args.tolerance, min_steps=args.min_steps, rule=args.rule,
                         device=args.device, progress=not args.quiet)
    snn.meta[META_KEY]["data"] = args.data
    out = args.out or os.path.dirname(src) or "."
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, os.path.basename(src))
    snn.to("cpu").save(path)
    say(args, f"on {rec.images:,} held-out images: {rec.accuracy_fixed:.2f}% at T={T}, {rec.accuracy:.2f}% with "
              f"early exit at a mean of {rec.mean_steps:.2f} steps ({rec.rule.describe()}); images stopping at "
              f"step 1..{T}: {rec.histogram}")
    print(f"wrote {path}: its early-exit rule, which snnconv evaluate uses from now on")
    return 0


def _cmd_report(args) -> int:
    from snnconv.analysis.report import write_report

    if os.path.isfile(args.run_dir):
        folder = os.path.dirname(args.run_dir) or "."
        raise UsageError(f"{args.run_dir} is a file, not a run folder; give the folder holding it: "
                         f"snnconv report {folder}")
    path = write_report(args.run_dir, args.out)
    print(path)
    return 0


def _cmd_diagnose(args) -> int:
    from snnconv.analysis.diagnosis import diagnose, needed_T
    from snnconv.analysis.plots import plot_diagnosis

    snn, src = load_snn(args, args.snn)
    folder = os.path.dirname(src) or "."
    model_name = args.model or recorded(folder, "model")
    weights = args.weights or os.path.join(folder, "ann.pt")
    if not model_name:
        raise UsageError("diagnose compares the SNN with its ANN: give --model NAME|MODULE:FACTORY (and "
                         "--weights FILE), as for snnconv convert")
    if not os.path.exists(weights):
        raise UsageError(f"no ANN weights: {weights} does not exist; give --weights FILE (the state dict "
                         "the network was converted from)")
    train, test = loaders(args)
    in_channels = args.in_channels or test.dataset[0][0].shape[0]
    ann = load_model(weights, model_name, num_classes(args, test.dataset), in_channels, False)
    T = args.T or snn.T
    d = diagnose(snn, ann, test, T=T, images=args.images, ablation=not args.no_ablation, device=args.device,
                 progress=not args.quiet)
    if args.needed_T:
        d.needed = needed_T(ann, train, test, images=args.images, device=args.device, progress=not args.quiet)
    out = args.out or folder
    os.makedirs(out, exist_ok=True)
    run_id = snn.meta.get("run_id") if isinstance(snn.meta, dict) else None
    write_json(os.path.join(out, "diagnosis.json"), dict(d.to_dict(), network=os.path.basename(src), run_id=run_id))
    plot_diagnosis(d, os.path.join(out, "diagnosis.png"))
    say(args, d.summary())
    print(f"wrote {os.path.join(out, 'diagnosis.json')} and diagnosis.png")
    return 0


# --- the parsers ----------------------------------------------------------------------------

def add_evaluate(sub, pa: dict) -> None:
    p = add_command(sub, "evaluate", "accuracy by T, firing rates, synaptic operations and energy of an SNN",
                    "snnconv evaluate runs/d/snn.pt --data digits --T 1 2 4 8 16",
                    [pa["common"], pa["data"], pa["time"]], _cmd_evaluate)
    p.add_argument("snn", help="a saved SNN (snn.pt) or a run folder; the result goes to "
                               "evaluation.json beside it (or in --out)")
    g = p.add_argument_group("early exit (each image stops at the step where its answer is sure; with a rule "
                             "stored in the network by snnconv calibrate-exit, always)")
    g.add_argument("--early-exit", action="store_true",
                   help="also evaluate with early exit at the largest --T: the network's stored rule, else one "
                        "calibrated here on the training split that fine-tuning holds out (and not stored)")
    g.add_argument("--exit-tolerance", type=_tolerance, metavar="P",
                   help="calibrate early exit here with tolerance P (accuracy points it may give up against the "
                        "fixed T on the held-out images), whatever rule the network stores; implies --early-exit")


def _tolerance(text: str) -> float:
    """An argparse type: accuracy points in [0, 100]."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 <= value <= 100):
        raise argparse.ArgumentTypeError(f"{text!r} must be accuracy points in [0, 100]")
    return value


def add_calibrate_exit(sub, pa: dict) -> None:
    from snnconv.exit_rule import DEFAULT_EXIT_RULE, DEFAULT_TOLERANCE, EXIT_RULES

    p = add_command(sub, "calibrate-exit", "choose the early-exit rule of an SNN on held-out training images and "
                    "store it in the network file",
                    "snnconv calibrate-exit runs/d --data digits --tolerance 0.5", [pa["common"], pa["data"]],
                    _cmd_calibrate_exit)
    p.add_argument("snn", help="a saved SNN (snn.pt) or a run folder; the network file is rewritten with its rule "
                               "(or written to --out)")
    p.add_argument("--tolerance", type=_tolerance, default=DEFAULT_TOLERANCE, metavar="P",
                   help="accuracy points early exit may give up against the fixed T on the held-out images "
                        f"(default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--rule", choices=EXIT_RULES, default=DEFAULT_EXIT_RULE,
                   help=f"the score an image stops on: the top-1 minus top-2 margin of its mean readout, or its "
                        f"softmax confidence (default {DEFAULT_EXIT_RULE})")
    p.add_argument("--min-steps", type=positive_int, metavar="K",
                   help="no image stops before step K (default: chosen by the calibration, the K with the fewest "
                        "mean steps)")
    p.add_argument("--T", type=positive_int, help="the most steps an image runs (default: the network's own)")


def add_report(sub, pa: dict) -> None:
    p = add_command(sub, "report", "write one self-contained HTML page from a run folder",
                    "snnconv report runs/d   # writes runs/d/report.html", [pa["common"]], _cmd_report)
    p.add_argument("run_dir", help="a run folder (meta.json, finetune.json, evaluation.json, backends/)")


def add_diagnose(sub, pa: dict) -> None:
    p = add_command(sub, "diagnose", "where an SNN loses its ANN's accuracy: each IF layer's departure "
                    "from the ANN by cause, what each layer costs, what to do",
                    "snnconv diagnose runs/d --data digits   # writes runs/d/diagnosis.json",
                    [pa["common"], pa["data"], pa["model"]], _cmd_diagnose)
    p.add_argument("snn", help="a saved SNN (snn.pt) or a run folder")
    p.add_argument("--weights", help="the ANN's state dict (default: the run folder's ann.pt)")
    p.add_argument("--T", type=positive_int, help="time steps (default: the network's own)")
    p.add_argument("--images", type=positive_int, default=512, help="test images to diagnose on (default 512)")
    p.add_argument("--no-ablation", action="store_true",
                   help="only the departures by cause, not what each layer costs (one run per layer)")
    p.add_argument("--needed-T", action="store_true",
                   help="also the plain conversion at T = 4, 8, ..., 256: the steps this network needs")
