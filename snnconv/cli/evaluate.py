"""``snnconv evaluate`` and ``snnconv report``: what a saved SNN does, and a run folder as a page."""

from __future__ import annotations

import json
import os

from snnconv.analysis.energy import format_arithmetic
from snnconv.cli.common import (
    UsageError,
    add_command,
    evaluation,
    load_snn,
    loaders,
    print_accuracy,
    say,
    time_steps,
    write_json,
)

__all__ = ["add_evaluate", "add_report"]


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
    out = args.out or os.path.dirname(src) or "."
    path = os.path.join(out, "evaluation.json")
    before = _recorded(path) if os.path.exists(path) else None
    write_json(path, ev)
    print_accuracy(args, [(f"SNN T={t}", ev["accuracy"][str(t)]) for t in Ts], images=ev["images"])
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
