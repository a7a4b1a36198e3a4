"""Early exit on the few-step matrix's networks: the margin rule against the softmax rule.

For each architecture of ``--archs`` and seed, the matrix's ANN (``anns.cached_ann``: real
Fashion-MNIST, ``--epochs`` epochs on ``--subset`` training images), converted with
``convert(ann, loader, T=--T, finetune_epochs=--finetune-epochs)`` on those images (every other
setting at its default; ``--finetune-epochs default``: convert()'s own fine-tuning), then:

- one fixed-T run (:func:`snnconv.analysis.early_exit.observe_exits`) on ``--held`` training
  images that neither the ANN nor the conversion saw (the next images of the matrix's seeded
  permutation) and one on the test split (the first ``--test-images``);
- per rule kind and tolerance, the rule :func:`snnconv.calibrate_exit` chooses on the held-out
  images (with their labels; ``min_steps`` chosen, and fixed at 1) read on the test split: the
  test accuracy against the fixed T and the mean steps; beside it, the fewest mean steps any
  threshold (and ``min_steps``, where chosen) needs on the test images themselves (an oracle,
  the rule's best case);
- the fixed-T accuracy at T = 1..``--T`` (the truncated run) and, for the default kind at
  tolerance 0.3, the wall time of ``snn.run_with_exit`` against ``snn.run`` at the fixed T on
  the same ``--wall-images`` test images (the best of ``--repeats`` runs each, in turns,
  ``--threads`` threads).

Writes ``<out>.json`` (rows and the test curves, thinned to 200 points), ``<out>.md`` (the table)
and ``<out>.png`` (accuracy against mean steps on the test split: per rule the most accuracy any
threshold and ``min_steps`` reach in those steps, and from step 1).

    python -m benchmarks matrix early_exit --archs tv_resnet small_cnn mobilenet --out OUT/early_exit
    python -m benchmarks matrix early_exit --smoke --out /tmp/early_exit    # digits, one narrow net, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv.analysis.early_exit import observe_exits
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.exit_rule import DEFAULT_EXIT_RULE, EXIT_RULES
from snnconv.io.atomic import atomic_write_text

from .anns import cached_ann, datasets

TOLERANCES = (0.1, 0.3, 0.5, 1.0)


def _data(args, seed: int):
    """(ANN training images, held-out training images, test images) as TensorDatasets."""
    dataset = "digits" if args.smoke else "fmnist"
    train, test = datasets(dataset, args.subset, seed)
    if args.smoke:  # digits: the last fifth of the training split is held out
        n = len(train) * 4 // 5
        held = TensorDataset(*(t[n:] for t in train.tensors))
        train = TensorDataset(*(t[:n] for t in train.tensors))
    else:  # the images after the matrix's subset in its seeded permutation
        from snnconv.data import fashion_mnist

        full = fashion_mnist(None, train=True)
        idx = torch.randperm(len(full), generator=torch.Generator().manual_seed(1000 + seed))
        idx = idx[args.subset:args.subset + args.held]
        held = TensorDataset(*(t[idx] for t in full.tensors))
    if args.test_images:
        test = TensorDataset(*(t[:args.test_images] for t in test.tensors))
    return train, held, test


def _thin(steps: list[float], accuracy: list[float], points: int = 200) -> dict:
    """A curve's points, at most ``points`` of them (evenly by index, the ends kept)."""
    n = len(accuracy)
    keep = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)}) if n > points else range(n)
    return {"mean_steps": [steps[i] for i in keep], "accuracy": [accuracy[i] for i in keep]}


def _best(curves: list) -> tuple[list[float], list[float]]:
    """The most accuracy any point of ``curves`` reaches in at most each mean steps (what the
    calibration reaches where it chooses ``min_steps`` too)."""
    points = sorted((s, a) for c in curves for s, a in zip(c.mean_steps, c.accuracy))
    steps, accuracy, top = [], [], -1.0
    for s, a in points:
        if a > top:
            top = a
            steps.append(s)
            accuracy.append(a)
    steps.append(points[-1][0])  # flat to the most steps
    accuracy.append(top)
    return steps, accuracy


def job(arch: str, seed: int, args) -> dict:
    """One network: converted, its curves on the held-out and test images, the table's rows."""
    torch.manual_seed(seed)
    train, held, test = _data(args, seed)
    spec = dict(dataset="digits" if args.smoke else "fmnist", arch=arch, epochs=args.epochs, seed=seed,
                subset=None if args.smoke else args.subset, smoke=args.smoke, cache=args.cache)
    ann, _ = cached_ann(spec, train, torch.device("cpu"))
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    saved = os.path.join(args.cache, f"early_exit_{arch}_s{seed}_T{args.T}_ft{args.finetune_epochs}"
                                     f"{'_ee' if args.convert_early_exit else ''}.pt")
    extra = {"maxpool": "avg"} if arch == "vgg_max" else {}
    extra.update(finetune_epochs=args.finetune_epochs, early_exit=args.convert_early_exit)
    if os.path.exists(saved):  # converted by an earlier run of the same settings
        snn = snnconv.SpikingNetwork.load(saved)
        convert_s = float(snn.meta.get("benchmark_convert_seconds", math.nan))
    else:
        snn, meta = snnconv.convert(ann, loader, T=args.T, seed=seed, progress=False, **extra)
        convert_s = time.perf_counter() - start
        snn.meta["benchmark_convert_seconds"] = convert_s
        if "finetune" in [s.name for s in meta.stages]:  # the judge's decision on fine-tuning
            snn.meta["benchmark_finetune_judged"] = meta.stage("finetune").changes["kept"]
        snn.save(saved)
    held_loader, test_loader = DataLoader(held, batch_size=250), DataLoader(test, batch_size=250)
    on_held = observe_exits(snn, held_loader, T=args.T)
    on_test = observe_exits(snn, test_loader, T=args.T)
    test_curves = {(kind, m): on_test.curve(kind, m) for kind in EXIT_RULES for m in range(1, args.T + 1)}
    fixed = accuracy_by_T(snn, test_loader, range(1, args.T + 1))
    rows = []
    for kind in EXIT_RULES:
        for tol in args.tolerances:
            for min_steps in (None, 1):  # chosen by the calibration, and from the first step
                rec = on_held.calibrate(kind, tol, min_steps)
                t = test_curves[kind, rec.rule.min_steps]
                j = t.point(rec.rule.threshold)
                oracle = min(s for (k, m), c in test_curves.items() if k == kind and (min_steps is None or m == 1)
                             for a, s in zip(c.accuracy, c.mean_steps) if a >= c.accuracy_fixed - tol - 1e-9)
                rows.append({"arch": arch, "seed": seed, "kind": kind, "tolerance": tol,
                             "min_steps": "chosen" if min_steps is None else min_steps, "rule": rec.rule.to_dict(),
                             "held_accuracy": rec.accuracy, "held_fixed": rec.accuracy_fixed,
                             "held_steps": rec.mean_steps, "test_fixed": t.accuracy_fixed,
                             "test_accuracy": t.accuracy[j], "test_steps": t.mean_steps[j], "oracle_steps": oracle})
    # wall time on the test images: the fixed T, and the default rule at tolerance 0.3
    rule = on_held.calibrate(DEFAULT_EXIT_RULE, 0.3).rule
    x = test.tensors[0][:args.wall_images]
    fixed_s, exit_s = math.inf, math.inf  # the best of --repeats, taken in turns (a shared machine)
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            for part in x.split(250):
                snn.run(part, T=args.T)
            fixed_s = min(fixed_s, time.perf_counter() - start)
            start = time.perf_counter()
            for part in x.split(250):
                snn.run_with_exit(part, rule, T=args.T)
            exit_s = min(exit_s, time.perf_counter() - start)
    backends = on_backends(snn, test, rule, args)
    return {"arch": arch, "seed": seed, "T": args.T, "finetune_epochs": args.finetune_epochs,
            "backends": backends,
            "convert_early_exit": args.convert_early_exit,
            "convert_seconds": round(convert_s, 1), "finetune_judged": snn.meta.get("benchmark_finetune_judged"),
            "held_images": len(held), "test_images": len(test),
            "fixed_accuracy_by_T": {str(k): v for k, v in fixed.items()}, "rows": rows,
            "wall_per_image_ms": {"fixed_T": 1e3 * fixed_s / len(x), "early_exit": 1e3 * exit_s / len(x),
                                  "rule": rule.to_dict()},
            "test_curves": {kind: {"min_steps_chosen": _thin(*_best([c for (k, _), c in test_curves.items()
                                                                      if k == kind])),
                                   "from_step_1": _thin(test_curves[kind, 1].mean_steps,
                                                        test_curves[kind, 1].accuracy)}
                            for kind in EXIT_RULES}}


def on_backends(snn, test, rule, args) -> dict:
    """Through NIR (the analog prefix run first, as ``snnconv run`` does): the cpu backend's wall
    time per image at the fixed T against early exit with ``rule`` on ``--wall-images`` test
    images (the best of ``--repeats`` runs each, in turns), and loihi2-sim's accuracy and energy
    per image both ways on ``--chip-images``."""
    from snnconv.constructs.prefix import analog_prefix
    from snnconv.errors import NIRError

    try:
        graph = snnconv.export_nir(snn)
    except NIRError as exc:  # a network without a NIR form runs in torch only
        return {"no_nir_form": str(exc)}
    x, y = test.tensors[0][:args.wall_images], test.tensors[1][:args.wall_images]
    stem = analog_prefix(snn)
    if stem is not None:
        with torch.no_grad():
            x = stem(x)
    out: dict = {}
    cpu = snnconv.backends.get("cpu").compile(graph)
    best = {"fixed": math.inf, "exit": math.inf}
    right = {}
    for _ in range(args.repeats):
        for how, r in (("fixed", None), ("exit", rule)):
            start = time.perf_counter()
            runs = [cpu.run(part, args.T, exit_rule=r) for part in x.split(250)]
            best[how] = min(best[how], time.perf_counter() - start)
            answers = torch.cat([(run.outputs.mean(0) if r is None else run.extra["early_exit"]["output"]).argmax(1)
                                 for run in runs])
            right[how] = 100.0 * float((answers == y).double().mean())
    out["cpu"] = {"images": len(y), "wall_per_image_ms": {k: 1e3 * v / len(y) for k, v in best.items()},
                  "accuracy": right, "wall_ratio": best["exit"] / best["fixed"]}
    if args.chip_images:
        chip = snnconv.backends.get("loihi2-sim").compile(graph, reference=False)
        xc, yc = x[:args.chip_images], y[:args.chip_images]
        rec = {"images": len(yc)}
        for how, r in (("fixed", None), ("exit", rule)):
            run = chip.run(xc, args.T, exit_rule=r)
            answers = (run.outputs.mean(0) if r is None else run.extra["early_exit"]["output"]).argmax(1)
            rec[how] = {"accuracy": 100.0 * float((answers == yc).double().mean()),
                        "energy_per_image_uJ": 1e6 * run.extra["energy"]["per_image_J"],
                        "synops_per_image": run.extra["energy"]["synops_per_image"],
                        "mean_steps": float(run.extra["early_exit"]["mean_steps"]) if r is not None else args.T}
        rec["energy_ratio"] = rec["exit"]["energy_per_image_uJ"] / rec["fixed"]["energy_per_image_uJ"]
        out["loihi2-sim"] = rec
    return out


def table(jobs: list[dict]) -> str:
    """The markdown tables: per network, kind, tolerance and min_steps, the rule calibrated on the
    held-out images read on the test split; the fixed-T accuracies and the wall times."""
    lines = ["| network | seed | rule | tolerance | min_steps | test: fixed T | test: with exit | mean steps | "
             "oracle steps |", "|---|---|---|---|---|---|---|---|---|"]
    for j in jobs:
        for r in j["rows"]:
            chosen = f"{r['rule']['min_steps']} (chosen)" if r["min_steps"] == "chosen" else str(r["min_steps"])
            change = r["test_accuracy"] - r["test_fixed"]
            lines.append(f"| {r['arch']} | {r['seed']} | {r['kind']} | {r['tolerance']:g} | {chosen} | "
                         f"{r['test_fixed']:.2f} | {r['test_accuracy']:.2f} ({change:+.2f}) "
                         f"| {r['test_steps']:.2f} | {r['oracle_steps']:.2f} |")
    lines += ["", "| network | seed | fixed T = 1 .. T | torch wall per image, fixed T / early exit (ms) | "
              "cpu backend: accuracy fixed / exit, wall per image fixed / exit (ms), ratio | "
              "loihi2-sim: accuracy fixed / exit, mean steps, energy per image fixed / exit (uJ), ratio |",
              "|---|---|---|---|---|---|"]
    for j in jobs:
        byT = " / ".join(f"{v:.1f}" for v in j["fixed_accuracy_by_T"].values())
        w = j["wall_per_image_ms"]
        b = j.get("backends") or {}
        cpu, chip = b.get("cpu"), b.get("loihi2-sim")
        cpu_text = "" if not cpu else (
            f"{cpu['accuracy']['fixed']:.2f} / {cpu['accuracy']['exit']:.2f}, {cpu['wall_per_image_ms']['fixed']:.2f}"
            f" / {cpu['wall_per_image_ms']['exit']:.2f}, {cpu['wall_ratio']:.2f}x")
        chip_text = "" if not chip else (
            f"{chip['fixed']['accuracy']:.2f} / {chip['exit']['accuracy']:.2f}, {chip['exit']['mean_steps']:.2f}, "
            f"{chip['fixed']['energy_per_image_uJ']:.3g} / {chip['exit']['energy_per_image_uJ']:.3g}, "
            f"{chip['energy_ratio']:.2f}x")
        lines.append(f"| {j['arch']} | {j['seed']} | {byT} | {w['fixed_T']:.2f} / {w['early_exit']:.2f} | "
                     f"{cpu_text} | {chip_text} |")
    return "\n".join(lines)


def plot(jobs: list[dict], path: str) -> None:
    """Accuracy against mean steps on the test split, one panel per network: each rule's best
    accuracy at each mean steps (``min_steps`` free; dotted: from step 1) and the fixed-T points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(jobs), figsize=(4.2 * len(jobs), 3.4), squeeze=False)
    for ax, j in zip(axes[0], jobs):
        for (kind, c), color in zip(j["test_curves"].items(), ("C0", "C1")):
            ax.plot(c["min_steps_chosen"]["mean_steps"], c["min_steps_chosen"]["accuracy"], color=color,
                    label=f"early exit, {kind}")
            ax.plot(c["from_step_1"]["mean_steps"], c["from_step_1"]["accuracy"], ":", color=color,
                    label=f"early exit, {kind}, from step 1")
        fixed = j["fixed_accuracy_by_T"]
        ax.plot([int(k) for k in fixed], list(fixed.values()), "o--", color="grey", label="fixed T")
        top = max(fixed.values())
        ax.set_ylim(top - 15, top + 1)
        ax.set_title(f"{j['arch']} (seed {j['seed']})", fontsize=9)
        ax.set_xlabel("mean time steps per image")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _epochs(text: str) -> int | None:
    return None if text == "default" else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=["tv_resnet", "small_cnn", "mobilenet"])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=10, help="the ANN's training epochs (default 10)")
    ap.add_argument("--subset", type=int, default=5000, help="training images of the ANN and the conversion")
    ap.add_argument("--held", type=int, default=5000, help="held-out training images the rule is calibrated on")
    ap.add_argument("--test-images", type=int, default=0, help="the first N test images (default: all)")
    ap.add_argument("--finetune-epochs", type=_epochs, default=0,
                    help="convert()'s fine-tuning epochs, or 'default' (convert()'s own; default 0: none)")
    ap.add_argument("--convert-early-exit", action="store_true",
                    help="convert(..., early_exit=True): fine-tuning for early exit")
    ap.add_argument("--tolerances", type=float, nargs="+", default=list(TOLERANCES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall-images", type=int, default=2000, help="test images the wall time is measured on")
    ap.add_argument("--repeats", type=int, default=3, help="wall time: the best of this many runs of each")
    ap.add_argument("--chip-images", type=int, default=256,
                    help="test images loihi2-sim runs with and without early exit (0: none)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/snnconv/matrix"))
    ap.add_argument("--smoke", action="store_true", help="digits, one narrow small CNN, 4 ANN epochs: seconds")
    ap.add_argument("--out", default="early_exit", help="path of the results without extension")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.archs, args.epochs, args.seeds, args.T = ["small_cnn"], 4, 1, 4
    command = "python -m benchmarks matrix early_exit " + " ".join(sys.argv[1:] if argv is None else argv)
    jobs = []
    for seed in range(args.seeds):
        for arch in args.archs:
            jobs.append(job(arch, seed, args))
            print(f"{arch} seed {seed}: done", flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            atomic_write_text(args.out + ".json", json.dumps({"command": command, "jobs": jobs}, indent=1) + "\n")
    atomic_write_text(args.out + ".md", table(jobs) + "\n")
    plot(jobs, args.out + ".png")
    print(table(jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
