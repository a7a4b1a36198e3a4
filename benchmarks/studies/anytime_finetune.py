"""Fine-tuning for early exit: does training every readout from the first step (the horizons of
:func:`snnconv.defaults.anytime_horizons`) give more accuracy at equal mean steps than convert()'s
recipe (readouts at T/2, T and 2T)?

For one network of the few-step matrix (its ANN: 10 epochs on 5,000 Fashion-MNIST training
images), the training-free conversion at T=8 (what the default conversion returns where its judge
keeps no fine-tuning), then each recipe fine-tunes that same network (convert()'s budget, the ANN
distilled, ``finetune()`` directly, no judge): the accuracy of each after every step on the test
split, the margin rule calibrated on 5,000 held-out training images at tolerance 0.3 / 0.5 / 1,
and the best test accuracy any rule reaches within 1.5 ... 5 mean steps.

    python -m benchmarks.studies.anytime_finetune small_cnn --seed 0
    python -m benchmarks.studies.anytime_finetune small_cnn --seed 0 --recipes convert anytime 0.25 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.early_exit import observe_exits
from snnconv.defaults import anytime_horizons, default_finetune_epochs, finetune_recipe
from snnconv.io.atomic import atomic_write_text
from snnconv.stages.finetune import finetune

from ..matrix.anns import cached_ann
from ..matrix.early_exit import _data

BUDGETS = (1.5, 2.0, 2.5, 3.0, 4.0, 5.0)


def measure(net, held, test, T: int) -> dict:
    """Accuracy after each step, the calibrated rules read on the test split, the best accuracy
    within each mean-steps budget."""
    on_held, on_test = observe_exits(net, held, T=T), observe_exits(net, test, T=T)
    rec: dict = {"by_step": on_test.accuracy_by_step()}
    for tol in (0.3, 0.5, 1.0):
        c = on_held.calibrate("margin", tol)
        curve = on_test.curve("margin", c.rule.min_steps)
        j = curve.point(c.rule.threshold)
        rec[f"tolerance {tol:g}"] = {"rule": c.rule.to_dict(), "accuracy": curve.accuracy[j],
                                     "mean_steps": curve.mean_steps[j]}
    curves = [on_test.curve("margin", m) for m in range(1, T + 1)]
    rec["best_within"] = {str(b): max(a for c in curves for a, s in zip(c.accuracy, c.mean_steps) if s <= b + 1e-9)
                          for b in BUDGETS}
    return rec


def _recipe(name: str, T: int) -> dict:
    """The fine-tuning changes of one recipe of ``--recipes``."""
    if name == "convert":
        return {"anytime": False}
    horizons = anytime_horizons(T)
    if name == "anytime":
        return {"anytime": True}
    w = float(name)
    return {"anytime": True, "horizon_weights": tuple(w if h < T // 2 else 1.0 for h in horizons)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/snnconv/matrix"))
    ap.add_argument("--recipes", nargs="+", default=["anytime", "convert"],
                    help="'anytime' (every readout, equal weights), 'convert' (the readouts at T/2, T, 2T), or a "
                         "weight w: every readout, those before T/2 weighing w against 1 for the others")
    ap.add_argument("--out", default=None, help="the JSON file (default benchmarks/studies/results/...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out_path = args.out or os.path.join(os.path.dirname(__file__), "results",
                                        f"anytime_finetune_{args.arch}_s{args.seed}_T{args.T}.json")
    data = argparse.Namespace(smoke=False, subset=5000, held=5000, test_images=0)
    train, held, test = _data(data, args.seed)
    spec = dict(dataset="fmnist", arch=args.arch, epochs=10, seed=args.seed, subset=5000, smoke=False,
                cache=args.cache)
    ann, _ = cached_ann(spec, train, torch.device("cpu"))
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    held_l, test_l = DataLoader(held, batch_size=250), DataLoader(test, batch_size=250)
    start, _ = snnconv.convert(ann, loader, T=args.T, finetune_epochs=0, seed=args.seed, progress=False)
    out = {"command": "python -m benchmarks.studies.anytime_finetune " + " ".join(sys.argv[1:] if argv is None
                                                                                 else argv),
           "training-free": measure(start, held_l, test_l, args.T)}
    epochs = default_finetune_epochs(loader)
    for name in args.recipes:
        t0 = time.perf_counter()
        cfg = finetune_recipe(args.T, loader, epochs=epochs, seed=args.seed, **_recipe(name, args.T))
        tuned, history = finetune(start, loader, config=cfg, teacher=ann, progress=False)
        name = {"convert": "convert's recipe"}.get(name, name)
        out[name] = dict(measure(tuned, held_l, test_l, args.T), horizons=list(cfg.horizons or ()),
                         seconds=time.perf_counter() - t0)
        atomic_write_text(out_path, json.dumps(out, indent=1) + "\n")
        print(f"{name}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
