"""Robustness matrix: convert() with default settings on networks nobody tuned it for.

The GPU sweep (one H200, 16 CPU cores; about 5-7 minutes wall), run from the repository root:

    .venv/bin/python -m benchmarks matrix robustness --device cuda --jobs 14 --out $OUT/robustness

then, here, the table for benchmarks/README.md and the plot from its JSON:

    .venv/bin/python -m benchmarks matrix robustness --table $OUT/robustness.json

The CPU smoke test (digits, two tiny networks, 1 seed; 1-5 minutes on 2 shared cores):

    .venv/bin/python -m benchmarks matrix robustness --smoke --out /tmp/robustness_smoke

What runs. Five architectures written the way people write them (in ``anns.py``, none from
the zoo's training set-up): ``tv_resnet`` (torchvision-style BasicBlocks that reuse one
``nn.ReLU(inplace=True)`` twice, ``F.relu`` in the stem, a ``downsample`` shortcut, ``out +=
identity``), ``mobilenet`` (depthwise-separable blocks, a Linear-BatchNorm1d-ReLU-Dropout head),
``vgg_max`` (VGG with max-pooling, converted with ``maxpool="avg"``, the one non-default
argument), ``resnet20`` (the CIFAR ResNet-20 of ``snnconv.models``) and ``small_cnn``. Each is
trained on real Fashion-MNIST (28x28) for 2 epochs and for 10 epochs (SGD Nesterov, OneCycle
peak 0.1, batch 128, weight decay 5e-4, no augmentation), and the two small nets also on
scikit-learn's digits (2 and 30 epochs). To fit the GPU budget, ANN training (and the data
convert() calibrates and fine-tunes on) uses a seeded random subset of ``--train-subset``
Fashion-MNIST training images (default 20,000 of 60,000); every accuracy is on the FULL test
split (10,000 Fashion-MNIST images, 450 digits). Seeds 0, 1, 2: the seed decides the ANN's
initialisation and data order, the calibration loader's order and ``convert(seed=)``.

Each cell is ``convert(ann, loader, eval_loader=test, eval_T=(1, 2, 4, 8, 16, 32))`` with
every other setting at its default (T=8), recording the ANN, the folded ANN, the QCFS-ANN and
the SNN at each T; plus ``convert(..., T=4, finetune_epochs=1)`` on the 10-epoch
``tv_resnet``, ``mobilenet``, ``resnet20`` and ``small_cnn``. Comparison cells on the 10-epoch
Fashion-MNIST networks (``--no-variants`` skips them; they start only within
``--variants-budget`` seconds of the sweep's start, 240 by default, so the core cells finish in
the budget): the other threshold granularity than the default (``per_channel`` flipped), and
fine-tuning with alpha 4, lr 2e-3 (the ResNet-14 recipe). A conversion that raises
``ConversionError`` (collapse) is recorded as such and re-run with ``on_collapse="warn"`` to
record its accuracies. Results: ``<out>.json`` (one record per cell and a summary over seeds:
mean and worst), ``<out>.png``, and per-job JSON under ``<out>_runs/`` (an interrupted sweep
keeps what finished; a re-run skips finished jobs). ANN checkpoints are cached under
``<out>_cache/`` (state dicts).

``--torchvision`` runs torchvision's own ``resnet18``, ``vgg11_bn`` and ``mobilenet_v2`` (full
widths, ``TV_ARCHS``) instead, on Fashion-MNIST resized to 32x32 and replicated to 3 channels
("fmnist32"), trained ``--long-epochs``; with ``--low-t --cells ...`` the few-step cells.

Floors checked in the table (worst seed): conversion within 3.0 points of the ANN at T=16 and
1.0 at T=32; after fine-tuning, within 2.0 at T=4 and T=8 not below T=4 by more than 0.5.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..common import RESULTS, child_env, module_command
from .anns import FT_ARCHS, TV_ARCHS, cached_ann, datasets
from .cells import (
    LOW_T_CELLS,
    budget_plot,
    convert_cell,
    lever_pairs,
    lever_plot,
    lever_table,
    low_t_cells,
    low_t_plot,
    low_t_summary,
    low_t_table,
)

TS = (1, 2, 4, 8, 16, 32)


def run_job(job: dict) -> dict:
    """Train or load the ANN of ``job``, then its default cell and (if asked) its fine-tuning cell."""
    import logging

    logging.getLogger("spikingjelly").setLevel(logging.ERROR)
    torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    train, test_set = datasets(job["dataset"], job["subset"], job["seed"], job.get("fashion_root"))
    if job.get("test_limit"):
        test_set = TensorDataset(*(t[:job["test_limit"]] for t in test_set.tensors))
    t0 = time.perf_counter()
    ann, cached = cached_ann(job, train, device)
    out = dict(job, ann_cached=cached, ann_seconds=time.perf_counter() - t0, cells={})
    loader = DataLoader(train, batch_size=128, shuffle=True,
                        generator=torch.Generator().manual_seed(job["seed"]))
    test = DataLoader(test_set, batch_size=500 if device.type == "cuda" else 250)  # 500 x T=32 fits 12 processes
    Ts = tuple(job["Ts"])
    extra = {"maxpool": "avg"} if job["arch"] == "vgg_max" else {}
    extra.update(job.get("overrides") or {})
    if isinstance(extra.get("qcfs_train"), dict):  # --set "qcfs_train={'epochs': 1, 'lr': 1e-3}"
        from snnconv import QCFSTrainConfig

        extra["qcfs_train"] = QCFSTrainConfig(**{"seed": job["seed"], **extra["qcfs_train"]})
    if not cached:
        out["ann_epoch_seconds"] = out["ann_seconds"] / job["epochs"]
    if job.get("low_t"):
        out["cells"] = low_t_cells(job, ann, loader, test, device, extra)
        return out
    if not job.get("finetune_only"):
        out["cells"]["default"] = convert_cell(ann, loader, test, device, Ts, seed=job["seed"], **extra)
    if job["finetune"]:
        from snnconv import FinetuneConfig

        limit = {"max_steps_per_epoch": 3} if job["smoke"] else {}
        settings = job.get("finetune_overrides") or {}  # --finetune-set
        if job["smoke"] or settings:
            ft = dict(finetune_config=FinetuneConfig(**{"epochs": 1, "T": 4, "seed": job["seed"], **limit,
                                                        **settings}))
        else:
            ft = dict(finetune_epochs=1)
        out["cells"]["finetune"] = convert_cell(ann, loader, test, device, Ts, seed=job["seed"], T=4,
                                                 **extra, **ft)
        if job.get("variants") and time.time() < job.get("variants_until", math.inf):
            # the fine-tuning recipe of the ResNet-14 benchmark, for comparison
            cfg = FinetuneConfig(epochs=1, T=4, seed=job["seed"], alpha=4.0, lr=2e-3, **limit)
            out["cells"]["finetune_a4_lr2e-3"] = convert_cell(ann, loader, test, device, Ts, seed=job["seed"],
                                                               T=4, finetune_config=cfg, **extra)
    if job.get("variants") and time.time() < job.get("variants_until", math.inf):
        import snnconv

        # the other threshold granularity than convert()'s default, for comparison
        other = not inspect.signature(snnconv.convert).parameters["per_channel"].default
        out["cells"]["per_channel" if other else "per_layer"] = convert_cell(
            ann, loader, test, device, Ts, seed=job["seed"], per_channel=other, **extra)
    return out



# --- the sweep --------------------------------------------------------------------------------

def plan(args) -> list[dict]:
    if args.smoke:  # --tiny: one narrow network, two T
        grid = ([("digits", "small_cnn", 4)] if args.tiny
                else [("digits", a, e) for a in ("small_cnn", "tv_resnet") for e in (1, 3)])
        seeds, Ts, subset = (0,), (2, 4) if args.tiny else (1, 2, 4, 8), None
    elif args.torchvision:  # torchvision's builds at 3x32x32, trained briefly
        grid = [("fmnist32", a, args.long_epochs) for a in (args.archs or TV_ARCHS)]
        seeds, Ts, subset = tuple(range(args.seeds)), TS, args.train_subset
    else:
        archs = args.archs or ["tv_resnet", "mobilenet", "vgg_max", "resnet20", "small_cnn"]
        grid = [("fmnist", a, e) for a in archs for e in (2, args.long_epochs)]
        grid += [("digits", a, e) for a in ("small_cnn", "tv_resnet") if a in archs for e in (2, 30)]
        seeds, Ts, subset = tuple(range(args.seeds)), TS, args.train_subset
    threads = args.threads or max(1, (os.cpu_count() or 2) // max(1, args.jobs))
    jobs = []
    for dataset, arch, epochs in grid:
        for seed in seeds:
            long = epochs == max(e for d, a, e in grid if d == dataset and a == arch)
            jobs.append(dict(dataset=dataset, arch=arch, epochs=epochs, seed=seed, Ts=list(Ts),
                             subset=subset if dataset.startswith("fmnist") else None, smoke=args.smoke,
                             finetune=(long and arch in FT_ARCHS + tuple(TV_ARCHS)
                                       and (dataset != "digits" or args.smoke) and not args.no_finetune),
                             device=args.device, threads=threads, cache=args.cache or args.out + "_cache",
                             overrides=overrides(args.set),
                             finetune_overrides=overrides(args.finetune_set),
                             finetune_only=args.finetune_only,
                             fashion_root=args.fashion_root, test_limit=args.test_limit,
                             variants=not args.no_variants and long and (dataset != "digits" or args.smoke),
                             low_t=args.low_t, cells=args.cells))
    if args.low_t:  # the few-step cells: the long-trained Fashion-MNIST networks (smoke: digits)
        jobs = [j for j in jobs if j["epochs"] == max(e for d, a, e in grid if d == j["dataset"] and a == j["arch"])
                and (j["dataset"] != "digits" or args.smoke)]
    if args.finetune_only:
        jobs = [j for j in jobs if j["finetune"]]
    cost = {"resnet20": 5, "tv_resnet": 4, "mobilenet": 3, "vgg_max": 2, "small_cnn": 1,
            "tvm_vgg11_bn": 8, "tvm_mobilenet_v2": 7, "tvm_resnet18": 6}
    jobs.sort(key=lambda j: -(cost[j["arch"]] * j["epochs"] * (1 if j["dataset"] == "digits" else 3)
                              + 20 * j["finetune"]))
    if args.low_t:  # seed by seed: an interrupted sweep has whole seeds
        jobs.sort(key=lambda j: (j["seed"], -cost[j["arch"]]))
    return jobs


def overrides(pairs: list[str] | None) -> dict:
    """``--set key=value`` pairs as convert() keyword arguments (values as Python literals)."""
    import ast

    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set wants key=value, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def job_key(job: dict) -> str:
    return f"{job['dataset']}-{job['arch']}-e{job['epochs']}-s{job['seed']}"


def summarize(records: list[dict]) -> list[dict]:
    """One row per (dataset, arch, epochs, cell): mean and worst over seeds, gaps, floors."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        for cell, c in r.get("cells", {}).items():
            groups.setdefault((r["dataset"], r["arch"], r["epochs"], cell), []).append(c)
    rows = []
    for (dataset, arch, epochs, cell), cs in sorted(groups.items()):
        # per-T keys are strings once a record has been through JSON: compare as integers
        cs = [dict(c, snn={int(t): v for t, v in c["snn"].items()}) for c in cs]
        Ts = sorted({t for c in cs for t in c["snn"]})
        row = {"dataset": dataset, "arch": arch, "epochs": epochs, "cell": cell, "seeds": len(cs),
               "collapses": sum("collapse" in c for c in cs)}
        for key in ("ann", "qcfs"):
            vals = [c[key] for c in cs if c.get(key) is not None]
            row[key] = {"mean": statistics.fmean(vals), "worst": min(vals)} if vals else None
        row["snn"] = {}
        for t in Ts:
            vals = [c["snn"][t] for c in cs if t in c["snn"]]
            gaps = [c["ann"] - c["snn"][t] for c in cs if t in c["snn"]]
            row["snn"][t] = {"mean": statistics.fmean(vals), "worst": min(vals), "worst_gap": max(gaps)}
        if not cell.startswith("finetune"):
            checks = {16: 3.0, 32: 1.0}
            row["floors_met"] = all(t in row["snn"] and row["snn"][t]["worst_gap"] <= g for t, g in checks.items())
        else:
            drop = max(c["snn"][4] - c["snn"].get(8, math.inf) for c in cs) if 4 in row["snn"] else math.inf
            row["t8_minus_t4_worst"] = -drop
            row["floors_met"] = 4 in row["snn"] and row["snn"][4]["worst_gap"] <= 2.0 and drop <= 0.5
        row["convert_seconds_mean"] = statistics.fmean(c["seconds"] for c in cs)
        rows.append(row)
    return rows


def table(summary: list[dict], subset: int | None = None, test_limit: int | None = None) -> str:
    """The markdown table for benchmarks/README.md."""
    Ts = sorted({int(t) for r in summary for t in r["snn"]})
    head = ["data", "network", "ANN epochs", "cell", "ANN", "QCFS-ANN"] + [f"T={t}" for t in Ts] + ["floors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(v):
        return "-" if v is None else f"{v['mean']:.2f} ({v['worst']:.2f})"

    for r in summary:
        snn = {int(t): v for t, v in r["snn"].items()}
        flag = "met" if r["floors_met"] else "**missed**"
        if r["collapses"]:
            flag += f", {r['collapses']} collapse(s)"
        name = {"default": "default", "finetune": "finetune 1 ep, T=4",
                "finetune_a4_lr2e-3": "finetune 1 ep, T=4, alpha 4, lr 2e-3"}.get(r["cell"], r["cell"])
        lines.append("| " + " | ".join([r["dataset"], r["arch"], str(r["epochs"]), name, cell(r["ann"]),
                                        cell(r["qcfs"])] + [cell(snn.get(t)) for t in Ts] + [flag]) + " |")
    split = f"the first {test_limit} test images" if test_limit else "the full test split"
    note = (f"\nAccuracy (%) on {split}, mean (worst) over seeds; convert() defaults "
            "(vgg_max: maxpool='avg'). Floors: worst seed within 3.0 of the ANN at T=16 and 1.0 at "
            "T=32; fine-tuned: within 2.0 at T=4 and T=8 >= T=4 - 0.5.")
    if subset:
        note += f" Fashion-MNIST ANNs trained (and converted) on a seeded subset of {subset} training images."
    return "\n".join(lines) + note


def compare(paths: list[str], Ts=(4, 8, 16, 32)) -> str:
    """Markdown table: the same cells in several sweeps (one setting changed), worst-seed gap to
    the ANN at each T, QCFS-ANN mean, and how many cells meet the floors."""
    runs = []
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        settings = data.get("settings", {})
        label = " ".join((settings.get("set") or []) + (settings.get("finetune_set") or [])) or "defaults"
        runs.append((label, {(r["dataset"], r["arch"], r["epochs"], r["cell"]): r
                             for r in summarize(data["records"])}))
    keys = sorted(set.intersection(*(set(rows) for _, rows in runs)))
    head = ["data", "network", "ANN epochs", "run", "QCFS-ANN"] + [f"T={t} gap" for t in Ts] + ["floors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        for label, rows in runs:
            r = rows[key]
            gaps = [f"{r['ann']['mean'] - r['snn'][t]['mean']:.2f} ({r['snn'][t]['worst_gap']:.2f})"
                    if t in r["snn"] else "-" for t in Ts]
            lines.append("| " + " | ".join([key[0], key[1], str(key[2]), label,
                                            f"{r['qcfs']['mean']:.2f}" if r.get("qcfs") else "-"]
                                           + gaps + ["met" if r["floors_met"] else "missed"]) + " |")
    lines.append("")
    for label, rows in runs:
        met = sum(rows[k]["floors_met"] for k in keys)
        lines.append(f"- {label}: floors met in {met} of {len(keys)} cells")
    return "\n".join(lines) + "\n\nGap = ANN - SNN in points, mean (worst seed) over seeds."


def plot(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets_ = sorted({r["dataset"] for r in summary})
    fig, axes = plt.subplots(1, len(datasets_), figsize=(6 * len(datasets_), 4.5), squeeze=False)
    for ax, d in zip(axes[0], datasets_):
        for r in (r for r in summary if r["dataset"] == d):
            Ts = sorted(int(t) for t in r["snn"])
            gaps = [r["ann"]["mean"] - r["snn"][t]["mean"] for t in Ts]
            style = "-" if r["cell"] == "default" else ":"
            ax.plot(Ts, gaps, style, marker="o", label=f"{r['arch']} e{r['epochs']} {r['cell']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.axhline(3.0, color="grey", lw=0.5)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("T")
        ax.set_ylabel("ANN - SNN accuracy (points, mean over seeds)")
        ax.set_title(d)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _normalize(obj):
    """JSON round trip turns int keys into strings; make summary keys ints again."""
    for r in obj:
        r["snn"] = {int(t): v for t, v in r["snn"].items()}
    return obj


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (default cores/jobs)")
    p.add_argument("--out", default=os.path.join(RESULTS, "robustness"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--long-epochs", type=int, default=10)
    p.add_argument("--train-subset", type=int, default=20000)
    p.add_argument("--archs", nargs="*")
    p.add_argument("--fashion-root", default=None)
    p.add_argument("--test-limit", type=int, default=None,
                   help="evaluate on the first N test images only (debugging; the table wants the full split)")
    p.add_argument("--no-variants", action="store_true",
                   help="skip the comparison cells (other threshold granularity, fine-tuning alpha 4 lr 2e-3)")
    p.add_argument("--variants-budget", type=float, default=240.0,
                   help="seconds after the start within which comparison cells may still start (0: always)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: digits, 2 small nets, 1 seed")
    p.add_argument("--tiny", action="store_true",
                   help="seconds: --smoke with one narrow small_cnn, 4 ANN epochs, T = 2 and 4")
    p.add_argument("--no-finetune", action="store_true", help="skip the fine-tuning cells")
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE",
                   help="convert() settings for every cell (Python literals), to compare a default")
    p.add_argument("--finetune-set", nargs="*", metavar="KEY=VALUE",
                   help="FinetuneConfig settings for the fine-tuning cells (epochs 1, T=4 unless set)")
    p.add_argument("--low-t", action="store_true",
                   help="the few-step cells instead (LOW_T_CELLS): T=4 defaults, training-free T=8, "
                        "QCFS at L=T=4, hard reset at T=8 (and T=4 without labels: nolabel_T4), on the "
                        "long-trained networks")
    p.add_argument("--cells", nargs="*", choices=sorted(LOW_T_CELLS),
                   help="with --low-t: only these few-step cells")
    p.add_argument("--torchvision", action="store_true",
                   help="torchvision's resnet18 (max-pooling stem), vgg11_bn and mobilenet_v2 at full width "
                        "on Fashion-MNIST resized to 32x32, three channels (--long-epochs of training)")
    p.add_argument("--finetune-only", action="store_true",
                   help="only the fine-tuning cells (no default cell; to compare a fine-tuning setting)")
    p.add_argument("--cache", help="ANN checkpoint folder (default <out>_cache; share it between runs)")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a finished sweep")
    p.add_argument("--budget-plot", nargs="+", metavar="JSON",
                   help="with --out PNG: accuracy against the fine-tuning budget of the T4 cells of "
                        "--low-t sweeps run at different budgets")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="print the cells of finished sweeps side by side (one setting changed)")
    p.add_argument("--pairs", nargs="+", metavar="JSON",
                   help="baseline and lever sweeps on the same ANNs, in pairs: the paired table, "
                        "and its plot at --out (a .png)")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.smoke = args.smoke or args.tiny

    if args.compare:
        print(compare(args.compare))
        return 0
    if args.pairs:
        rows = lever_pairs(args.pairs)
        print(lever_table(rows))
        if args.out.endswith(".png"):
            lever_plot(rows, args.out)
        return 0
    if args.budget_plot:
        budget_plot(args.budget_plot, args.out)
        return 0
    if args.table:
        with open(args.table) as fh:
            data = json.load(fh)
        if data.get("settings", {}).get("low_t"):
            rows = low_t_summary(data["records"])
            print(low_t_table(rows))
            low_t_plot(rows, os.path.splitext(args.table)[0] + ".png")
            return 0
        # recomputed from the per-job records (a summary written by an older version may be stale)
        summary = summarize(data["records"]) if data.get("records") else _normalize(data["summary"])
        print(table(summary, data.get("train_subset"), data.get("settings", {}).get("test_limit")))
        plot(summary, os.path.splitext(args.table)[0] + ".png")
        return 0
    if args.job:
        job = json.loads(args.job)
        path = os.path.join(args.out + "_runs", job_key(job) + ".json")
        try:
            result = run_job(job)
        except Exception:
            result = dict(job, error=traceback.format_exc())
        from snnconv.io.atomic import atomic_write_text

        atomic_write_text(path, json.dumps(result, indent=1) + "\n")
        return 0 if "error" not in result else 1

    from snnconv.io.atomic import atomic_write_text

    jobs = plan(args)
    if args.variants_budget:
        for job in jobs:  # comparison cells start only within this many seconds of the sweep
            job["variants_until"] = time.time() + args.variants_budget
    runs = args.out + "_runs"
    os.makedirs(runs, exist_ok=True)
    start = time.perf_counter()
    print(f"{len(jobs)} jobs, {args.jobs} at a time, {jobs[0]['threads']} thread(s) each", flush=True)

    def launch(job):
        path = os.path.join(runs, job_key(job) + ".json")
        if os.path.exists(path):
            with open(path) as fh:
                done = json.load(fh)
            if "error" not in done:
                return done
        log = open(os.path.join(runs, job_key(job) + ".log"), "w")
        t0 = time.perf_counter()
        env = child_env(OMP_NUM_THREADS=str(job["threads"]), PYTHONWARNINGS="ignore")
        cmd = module_command("benchmarks.matrix.robustness", "--out", args.out, "--job", json.dumps(job))
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        with open(path) as fh:
            done = json.load(fh)
        print(f"[{time.perf_counter() - start:6.0f}s] {job_key(job)} rc={rc} "
              f"{time.perf_counter() - t0:.0f}s" + (" ERROR" if "error" in done else ""), flush=True)
        return done

    records = []

    def write():
        ok = [r for r in records if "error" not in r]
        summary = low_t_summary(ok) if args.low_t else summarize(ok)
        atomic_write_text(args.out + ".json", json.dumps(
            {"settings": {k: v for k, v in vars(args).items() if k not in ("job", "table")},
             "train_subset": None if args.smoke else args.train_subset,
             "wall_seconds": time.perf_counter() - start, "errors": [job_key(r) for r in records if "error" in r],
             "summary": summary, "records": ok}, indent=1) + "\n")
        return summary

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done in pool.map(launch, jobs):
            records.append(done)
            write()
    summary = _normalize(json.loads(json.dumps(write())))
    errors = [job_key(r) for r in records if "error" in r]
    if not summary:  # every job failed: nothing to plot, and the logs say why
        print(f"no cell finished; errors in: {', '.join(errors)} (see {runs}/*.log)")
        return 1
    if args.low_t:
        low_t_plot(summary, args.out + ".png")
        print(low_t_table(summary))
        print(f"wall {time.perf_counter() - start:.0f}s; {args.out}.json")
        return 1 if errors else 0
    plot(summary, args.out + ".png")
    print(table(summary, None if args.smoke else args.train_subset, args.test_limit))
    print(f"wall {time.perf_counter() - start:.0f}s; {args.out}.json, {args.out}.png")
    if errors:
        print("errors in: " + ", ".join(errors) + f" (see {runs}/*.log)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
