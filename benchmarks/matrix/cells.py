"""The conversion cells of the robustness matrix: one ``convert()`` call per cell, and the
few-step cells (``--low-t``) with their floors, table and plot."""

from __future__ import annotations

import inspect
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset


def convert_cell(ann, loader, test, device, Ts, **options) -> dict:
    import snnconv

    has_on_collapse = "on_collapse" in inspect.signature(snnconv.convert).parameters
    t0 = time.perf_counter()
    record: dict = {"options": {k: dict(vars(v)) if k == "qcfs_train" else v
                                for k, v in options.items() if k != "finetune_config"}}
    try:
        _, meta = snnconv.convert(ann, loader, eval_loader=test, eval_T=Ts, device=device,
                                  progress=False, **options)
    except snnconv.SnnconvError as exc:
        if not (has_on_collapse and type(exc).__name__ == "ConversionError"):
            raise
        record["collapse"] = str(exc)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, meta = snnconv.convert(ann, loader, eval_loader=test, eval_T=Ts, device=device,
                                      progress=False, on_collapse="warn", **options)
    record["seconds"] = time.perf_counter() - t0
    acc = meta.accuracy
    record.update(ann=acc.get("ann"), folded=acc.get("folded"), qcfs=acc.get("qcfs"),
                  snn={int(t): a for t, a in acc.get("snn", {}).items()},
                  stage_seconds={s.name: s.seconds for s in meta.stages},
                  budget=meta.settings.get("budget"))
    for s in meta.stages:
        if s.name == "finetune":
            record["finetune_history"] = s.changes.get("history")
    activity = {s.name: s.changes["activity"] for s in meta.stages if "activity" in s.changes}
    if activity:
        record["activity"] = activity
    return record


#: The few-step cells (``--low-t``): name -> (convert() arguments, T values evaluated, floors).
#: A floor is (kind, T, points): "gap" = worst-seed ANN - SNN at T; "qcfs_gap" = QCFS-ANN - SNN
#: at T; "not_below" = SNN at T minus SNN at 4 (worst seed) must be >= -points. ``free_T8``:
#: training-free without labels; ``nolabel_T8``: convert()'s default on those unlabelled images
#: at T=8 (fine-tuning distilled from the ANN's outputs alone); ``nolabel_T4``: convert()'s default on the same
#: unlabelled
#: images (fine-tuning distilled from the ANN's outputs alone); ``kd_qcfs_T4``: ``T4`` with
#: convert()'s QCFS training steps on every network, distilled from the ANN (labels unread).
LOW_T_CELLS = {
    "T4": (dict(T=4), (2, 4, 8), (("gap", 4, 1.0), ("gap", 2, 3.0), ("not_below", 8, 0.0))),
    "free_T8": (dict(T=8, unlabelled=True, finetune_epochs=0), (8,), (("gap", 8, 2.0),)),
    "nolabel_T8": (dict(T=8, unlabelled=True), (4, 8), (("gap", 8, 2.0),)),
    "nolabel_T4": (dict(T=4, unlabelled=True), (2, 4, 8),
                   (("gap", 4, 1.0), ("gap", 2, 3.0), ("not_below", 8, 0.0))),
    "qcfs_L4": (dict(T=4, L=4, qcfs_epochs=3, finetune_epochs=0), (4,), (("qcfs_gap", 4, 3.0),)),
    "hard_T8": (dict(T=8, reset="zero"), (8,), (("gap", 8, 2.0),)),
    "kd_qcfs_T4": (dict(T=4, qcfs_distill=1.0), (2, 4, 8),
                   (("gap", 4, 1.0), ("gap", 2, 3.0), ("not_below", 8, 0.0))),
}


def _unlabelled(loader: DataLoader) -> DataLoader:
    """The same images in the same order, without labels."""
    return DataLoader(TensorDataset(loader.dataset.tensors[0]), batch_size=loader.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(loader.generator.initial_seed()),
                      collate_fn=lambda b: torch.stack([t[0] for t in b]))


def low_t_cells(job: dict, ann, loader, test, device, extra: dict) -> dict:
    """The cells of :data:`LOW_T_CELLS` for one ANN (vgg_max: no training-free cell, its
    QCFS training at convert()'s default, distilled from the ANN without labels)."""
    cells = {}
    for name, (options, Ts, _) in LOW_T_CELLS.items():
        if job.get("cells") and name not in job["cells"]:
            continue
        options = dict(options)
        if "vgg" in job["arch"]:
            if options.get("unlabelled") and options.get("finetune_epochs") == 0:
                continue  # training-free: max-pooling becomes average pooling, trained for
            if "qcfs_epochs" in options:
                options["qcfs_epochs"] = None
        data = _unlabelled(loader) if options.pop("unlabelled", False) else loader
        if "qcfs_distill" in options:  # convert()'s default QCFS steps, distilled from the ANN
            from snnconv.defaults import QCFS_STEPS, _qcfs_epochs
            from snnconv.stages.qcfs import QCFSTrainConfig

            options["qcfs_train"] = QCFSTrainConfig(epochs=_qcfs_epochs(data), max_steps=QCFS_STEPS,
                                                    seed=job["seed"], distill=options.pop("qcfs_distill"))
        if job["smoke"] and options.get("qcfs_epochs"):
            options["qcfs_epochs"] = 1
        if job.get("finetune_overrides") and options.get("finetune_epochs") != 0:
            # --finetune-set: convert()'s own fine-tuning recipe with those fields changed
            from snnconv.defaults import LABEL_FREE_DISTILL, default_finetune_epochs, finetune_recipe

            options["finetune_config"] = finetune_recipe(
                options["T"], data, epochs=default_finetune_epochs(data), seed=job["seed"],
                reset=options.get("reset", "subtract"),
                **({} if data is loader else {"distill": LABEL_FREE_DISTILL}), **job["finetune_overrides"])
        cells[name] = convert_cell(ann, data, test, device, Ts, seed=job["seed"], **extra, **options)
    return cells


def low_t_summary(records: list[dict]) -> list[dict]:
    """One row per (arch, epochs, cell) of the few-step cells: worst seed, floors."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in records:
        for cell, c in r.get("cells", {}).items():
            groups.setdefault((r["dataset"], r["arch"], r["epochs"], cell), []).append((r, c))
    rows = []
    for (dataset, arch, epochs, cell), rcs in sorted(groups.items()):
        cs = [dict(c, snn={int(t): v for t, v in c["snn"].items()}) for _, c in rcs]
        row = {"dataset": dataset, "arch": arch, "epochs": epochs, "cell": cell, "seeds": len(cs),
               "ann": [c["ann"] for c in cs], "qcfs": [c["qcfs"] for c in cs],
               "snn": {t: [c["snn"][t] for c in cs] for t in sorted(cs[0]["snn"])}, "floors": []}
        for kind, t, points in LOW_T_CELLS[cell][2]:
            if kind == "gap":
                worst = max(c["ann"] - c["snn"][t] for c in cs)
            elif kind == "qcfs_gap":
                worst = max(c["qcfs"] - c["snn"][t] for c in cs)
            else:
                worst = max(c["snn"][4] - c["snn"][t] for c in cs)
            row["floors"].append({"kind": kind, "T": t, "points": points, "worst": worst,
                                  "met": worst <= points})
        ratios = [c["seconds"] / r["ann_epoch_seconds"] for r, c in rcs if r.get("ann_epoch_seconds")]
        row["cost_ann_epochs"] = statistics.fmean(ratios) if ratios else None
        row["seconds"] = statistics.fmean(c["seconds"] for c in cs)
        rows.append(row)
    return rows


def low_t_table(rows: list[dict]) -> str:
    """The markdown table of the few-step cells: mean (worst) accuracy, each floor's worst value."""
    head = ["network", "cell", "ANN", "QCFS-ANN", "SNN by T: mean (worst)", "floors: worst seed",
            "cost (ANN epochs)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def mw(v):
        return f"{statistics.fmean(v):.2f} ({min(v):.2f})"

    names = {"gap": "ANN - T={}", "qcfs_gap": "QCFS-ANN - T={}", "not_below": "T=4 - T={}"}
    for r in rows:
        snn = ", ".join(f"T={t}: {mw(v)}" for t, v in r["snn"].items())
        floors = "; ".join(f"{names[f['kind']].format(f['T'])} {f['worst']:.2f} "
                           f"{'<=' if f['met'] else '**>**'} {f['points']:.1f}" for f in r["floors"])
        cost = "-" if r["cost_ann_epochs"] is None else f"{r['cost_ann_epochs']:.1f}"
        lines.append("| " + " | ".join([f"{r['arch']} ({r['epochs']} ep)", r["cell"], mw(r["ann"]),
                                        mw(r["qcfs"]), snn, floors, cost]) + " |")
    return "\n".join(lines)


def low_t_plot(rows: list[dict], path: str) -> bool:
    """Worst-seed gap to the ANN against T of the cells evaluated at several T (``T4``,
    ``nolabel_T4``), one line per network and cell, with the floors at T=2 and T=4. Writes
    nothing, and returns False, where no cell has more than one T."""
    rows = [r for r in rows if len(r["snn"]) > 1]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        Ts = sorted(r["snn"])
        gaps = [max(a - s for a, s in zip(r["ann"], r["snn"][t])) for t in Ts]
        cell = "" if r["cell"] == "T4" else f" {r['cell']}"
        ax.plot(Ts, gaps, marker="o", label=f"{r['arch']}{cell} ({r['seeds']} seed{'s' * (r['seeds'] > 1)})")
    ax.plot([2, 4], [3.0, 1.0], "k_", markersize=18, mew=2, label="floor")
    ax.set_xscale("log", base=2)
    ax.set_xticks([2, 4, 8], ["2", "4", "8"])
    ax.set_xlabel("time steps T")
    ax.set_ylabel("ANN - SNN, worst seed (points)")
    ax.set_title("convert(..., T=4): gap to the ANN")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def budget_points(records: list[dict], seed: int = 0) -> dict[str, list[tuple[int, dict[int, float]]]]:
    """arch -> [(fine-tuning steps run, {T: accuracy})] of the ``T4`` cells of ``seed``."""
    points: dict[str, list[tuple[int, dict[int, float]]]] = {}
    for r in records:
        c = r.get("cells", {}).get("T4")
        if r["seed"] != seed or not c or not c.get("budget"):
            continue
        points.setdefault(r["arch"], []).append(
            (int(c["budget"]["finetune_steps_run"]), {int(t): a for t, a in c["snn"].items()}))
    return {a: sorted(p, key=lambda s: s[0]) for a, p in sorted(points.items())}


def budget_plot(paths: list[str], out: str, seed: int = 0) -> None:
    """Accuracy against the fine-tuning budget (optimiser steps) of the ``T4`` cells in the
    sweeps ``paths`` (one per budget), one panel per evaluated T, one line per network."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            records += json.load(fh)["records"]
    points = budget_points(records, seed)
    Ts = sorted({t for p in points.values() for _, snn in p for t in snn})
    fig, axes = plt.subplots(1, len(Ts), figsize=(3.6 * len(Ts), 3.6), squeeze=False)
    for ax, t in zip(axes[0], Ts):
        for arch, p in points.items():
            steps = [s for s, snn in p if t in snn]
            ax.plot(steps, [snn[t] for _, snn in p if t in snn], marker="o", label=arch)
        ax.set_xscale("log", base=2)
        ticks = sorted({s for p in points.values() for s, _ in p})
        ax.set_xticks(ticks, [str(s) for s in ticks])
        ax.minorticks_off()
        ax.set_xlabel("fine-tuning optimiser steps")
        ax.set_title(f"T = {t}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"SNN accuracy (%), seed {seed}")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("convert(model, loader, T=4): accuracy against the fine-tuning budget")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def lever_pairs(paths: list[str]) -> list[dict]:
    """The cells of sweeps run on the same ANNs, in pairs of paths (a baseline, then the sweep
    with one lever changed): per (network, seed, cell) both accuracies at each evaluated T."""
    import json

    def cells(path):
        with open(path, encoding="utf-8") as fh:
            records = json.load(fh)["records"]
        return {(r["arch"], r["seed"], cell): c for r in records for cell, c in r.get("cells", {}).items()}

    rows = []
    for base_path, lever_path in zip(paths[::2], paths[1::2]):
        base, lever = cells(base_path), cells(lever_path)
        label = lever_path.rsplit("/", 1)[-1].removesuffix(".json")
        for key in sorted(set(base) & set(lever)):
            b, v = base[key], lever[key]
            rows.append({"lever": label, "arch": key[0], "seed": key[1], "cell": key[2], "ann": b["ann"],
                         "qcfs": (b.get("qcfs"), v.get("qcfs")),
                         "snn": {int(t): (b["snn"][t], v["snn"][t]) for t in sorted(b["snn"], key=int)},
                         "seconds": (b["seconds"], v["seconds"])})
    return rows


def lever_table(rows: list[dict]) -> str:
    """Markdown: per pair, the baseline -> lever accuracy at each T and the QCFS-ANN."""
    lines = ["| lever | network | seed | cell | ANN | QCFS-ANN | SNN: baseline -> lever (change) | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["qcfs"]
        qcfs = "-" if q[0] is None else f"{q[0]:.2f} -> {q[1]:.2f}"
        snn = "; ".join(f"T={t}: {b:.2f} -> {v:.2f} ({v - b:+.2f})" for t, (b, v) in r["snn"].items())
        lines.append(f"| {r['lever']} | {r['arch']} | {r['seed']} | {r['cell']} | {r['ann']:.2f} | {qcfs} | "
                     f"{snn} | {r['seconds'][0]:.0f} -> {r['seconds'][1]:.0f} |")
    return "\n".join(lines)


def lever_plot(rows: list[dict], path: str) -> None:
    """One bar per (lever, network, seed, T): the lever's change of the SNN's accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{r['lever']}\n{r['arch']} s{r['seed']} T={t}", v - b) for r in rows for t, (b, v) in r["snn"].items()]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(bars)), 4.6))
    ax.bar(range(len(bars)), [d for _, d in bars], color=["tab:green" if d > 0 else "tab:red" for _, d in bars])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(bars)), [n for n, _ in bars], rotation=90, fontsize=6)
    ax.set_ylabel("SNN accuracy, lever - baseline (points)")
    ax.set_title("Levers on the few-step matrix (same ANNs)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
