"""``snnconv evaluate`` and ``snnconv report``: what a saved SNN does, and a run folder as a page."""

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

__all__ = ["add_evaluate", "add_report", "add_diagnose"]


def _recorded(path: str) -> str:
    """``"snn.pt at T=1, 2, 4 on 449 images"``: what the evaluation.json at ``path`` measured."""
    try:
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        Ts = ", ".join(sorted(old.get("accuracy", {}), key=int))
        return f"{old.get('network', 'a network')} at T={Ts} on {old.get('images', 'an unrecorded number of')} images"
    except (OSError, ValueError, AttributeError, TypeError):
        return "an earlier record"


def _cmd_evaluate(args) -> int:
    snn, src = load_snn(args, args.snn)
    snn = snn.to(args.device)
    Ts = time_steps(args)
    _, test = loaders(args)
    ev = evaluation(args, snn, test, Ts, os.path.basename(src))
    if isinstance(snn.meta, dict) and snn.meta.get("calibrated_T"):
        ev["calibrated_T"] = snn.meta["calibrated_T"]
    out = args.out or os.path.dirname(src) or "."
    path = os.path.join(out, "evaluation.json")
    before = _recorded(path) if os.path.exists(path) else None
    write_json(path, ev)
    print_accuracy(args, [(f"SNN T={t}", ev["accuracy"][str(t)]) for t in Ts], images=ev["images"])
    calibrated = snn.meta.get("calibrated_T") if isinstance(snn.meta, dict) else None
    if calibrated and any(t != calibrated for t in Ts):
        say(args, f"(this network was calibrated for T={calibrated}; at other T it runs the same network for "
                  "more or fewer steps, not a conversion made for that T)")
    rates = ev["analysis"]["firing_rate"]
    e = ev["analysis"]["energy"]
    say(args, f"mean firing rate {100 * sum(rates.values()) / max(1, len(rates)):.2f}% per step "
              f"(the first {ev['analysis']['batch']} test images at T={ev['analysis']['T']})")
    say(args, format_arithmetic(e))
    # the one line --quiet keeps: where the result went, and what it replaced
    print(f"wrote {path}: {_recorded(path)}" + (f" (it replaces {before})" if before else ""))
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
