"""The networks built for the edge at few steps: real ANNs, the default conversion against the ANN.

For each torchvision network of ``--models`` (default: ``regnet_x_400mf``, ``mobilenet_v2``,
``shufflenet_v2_x0_5``, ``mnasnet0_5``, ``resnet50``), an ANN trained on the whole Fashion-MNIST
training set at 3x32x32 (grey replicated to three channels; SGD Nesterov, OneCycle, batch 64,
``--epochs`` epochs, cached under ``--cache``; its BatchNorm statistics recomputed over the
training images, as :func:`benchmarks.coverage.loihi2.trained` does; ``<out>/anns.json``), then
converted on ``--convert-images`` training images (a seeded random subset, batch 64), each cell one
``convert()`` call evaluated on the first ``--test-images`` test images:

- ``default_T4``: ``convert(ann, loader, T=4)``, the default with its fine-tuning;
- ``free_T8``: ``convert(ann, loader, T=8, finetune_epochs=0)``, training-free;
- ``free_T4``: ``convert(ann, loader, T=4, finetune_epochs=0)``, with :func:`snnconv.diagnose` at
  T=4 beside it (its main layers, and the accuracy they recover run as ANN activations);
- ``burst4_T4`` and ``burst4_free_T4``: the same as ``default_T4`` and ``free_T4`` with
  ``burst=4`` (neurons that may emit up to 4 spikes in one step: 16 levels in 4 steps).

Cells are written as they finish (``<out>/cells.json``; ``--cells`` picks them); a rerun skips
the cells it already has, and the converted networks are not kept.

    python -m benchmarks matrix edge [--models mobilenet_v2,regnet_x_400mf] [--cells default_T4 free_T8]
    python -m benchmarks matrix edge --train-only      # only the ANNs
    python -m benchmarks matrix edge --table           # the table and plot from cells.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Subset

import snnconv
from snnconv.analysis.diagnosis import diagnose
from snnconv.analysis.metrics import evaluate
from snnconv.constructs.prefix import analog_prefix
from snnconv.io.atomic import atomic_write_text

from ..common import RESULTS
from ..coverage.loihi2 import fmnist, log, trained

EDGE = ("regnet_x_400mf", "mobilenet_v2", "shufflenet_v2_x0_5", "mnasnet0_5", "resnet50")
SIZE = 32


def ann_row(name: str, epochs: int, cache: str, test_images: int) -> dict:
    """The trained ANN's record: its recipe, training seconds (0 when cached) and test accuracy."""
    train, test = fmnist(SIZE, 60000, test_images)
    start = time.perf_counter()
    model = trained(name, SIZE, train, epochs, cache)
    seconds = time.perf_counter() - start
    acc = evaluate(model, DataLoader(test, batch_size=256), torch.device("cpu"))
    return {"model": name, "size": SIZE, "train_images": len(train), "epochs": epochs,
            "recipe": "SGD Nesterov 0.9, wd 5e-4, OneCycle peak 0.05, batch 64, grad-norm clip 5",
            "train_seconds": round(seconds, 1), "test_images": len(test), "ann": acc}


#: Each cell: convert()'s settings, whether the diagnosis runs beside it, and whether the network
#: is exported to NIR and run by the cpu and loihi2-sim backends (``--chip-images`` test images).
CELLS = {
    "default_T4": (dict(T=4), False, False),
    "free_T8": (dict(T=8, finetune_epochs=0), False, False),
    "free_T4": (dict(T=4, finetune_epochs=0), True, False),
    "burst4_T4": (dict(T=4, burst=4), False, False),
    "burst4_free_T4": (dict(T=4, burst=4, finetune_epochs=0), True, False),
    "burst4_free_T4_chip": (dict(T=4, burst=4, finetune_epochs=0), False, True),
}


def _write(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


def _read(path: str) -> list:
    return json.load(open(path))["rows"] if os.path.exists(path) else []


def cell(name: str, cell_name: str, args) -> dict:
    """One conversion of the cached ANN ``name`` as the cell says, evaluated (and diagnosed)."""
    settings, diagnosed, chip = CELLS[cell_name]
    train, test = fmnist(SIZE, 60000, args.test_images)
    model = trained(name, SIZE, train, args.epochs, args.cache)
    picks = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))[:args.convert_images]
    loader = DataLoader(Subset(train, picks.tolist()), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    test_loader = DataLoader(test, batch_size=250)
    start = time.perf_counter()
    snn, meta = snnconv.convert(model, loader, eval_loader=test_loader, seed=args.seed, on_collapse="warn",
                                progress=not args.quiet, **settings)
    row = {"model": name, "cell": cell_name, "settings": settings, "seed": args.seed,
           "convert_images": args.convert_images, "test_images": len(test), "ann": meta.accuracy["ann"],
           "snn": meta.accuracy["snn"][str(settings["T"])], "seconds": round(time.perf_counter() - start, 1),
           "stages": {st.name: round(st.seconds, 1) for st in meta.stages},
           "kept": {**meta.stage("spiking").changes.get("kept", {}),
                    **({"finetune": meta.stage("finetune").changes["kept"]}
                       if any(st.name == "finetune" for st in meta.stages) else {})}}
    row["gap"] = row["ann"] - row["snn"]
    if diagnosed:
        d = diagnose(snn, model, test_loader, T=settings["T"], images=args.diagnose_images, progress=not args.quiet)
        row["diagnosis"] = {"ann": d.ann_accuracy, "snn": d.snn_accuracy, "layers": len(d.layers),
                            "main": d.main, "main_accuracy": d.main_accuracy, "recovered": d.recovered,
                            "gap_recovered": d.gap_recovered(), "images": d.images,
                            "causes": {layer.name: dict(layer.causes, own=layer.own, kl=layer.kl_recovered)
                                       for layer in d.layers}}
    if chip:
        row["chip"] = on_chip(snn, test, settings["T"], args.chip_images)
    return row


def on_chip(snn, test, T: int, images: int) -> dict:
    """``snn`` through NIR on the first ``images`` test images: the cpu backend (the float
    network) and loihi2-sim (Loihi 2's fixed-point arithmetic, 8-bit weights, graded spikes
    for bursts): accuracy of each, their agreement, and loihi2-sim's energy per image."""
    graph = snnconv.export_nir(snn)
    x, y = test.tensors[0][:images], test.tensors[1][:images]
    stem = analog_prefix(snn)  # the static first layers run once per image, off the graph
    if stem is not None:
        with torch.no_grad():
            x = stem(x)
    out = {"images": int(len(y))}
    decisions = {}
    for backend in ("cpu", "loihi2-sim"):
        start = time.perf_counter()
        program = snnconv.backends.get(backend).compile(graph)
        parts = [program.run(part, T) for part in x.split(32)]
        decisions[backend] = torch.cat([r.outputs.mean(0).argmax(1) for r in parts])
        out[backend] = 100.0 * float((decisions[backend] == y).float().mean())
        out[f"{backend}_seconds"] = round(time.perf_counter() - start, 1)
        if backend == "loihi2-sim":  # the first batch's energy record (per image)
            out["loihi2_energy"] = parts[0].extra.get("energy")
    out["agreement"] = 100.0 * float((decisions["cpu"] == decisions["loihi2-sim"]).float().mean())
    return out


def table(rows: list) -> str:
    """The cells as a markdown table: one row per network, the accuracy (gap) of each cell."""
    names = [c for c in CELLS if any(r["cell"] == c for r in rows)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = ["| network | ANN | " + " | ".join(f"`{c}`" for c in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for m in models:
        got = {r["cell"]: r for r in rows if r["model"] == m}
        ann = next(iter(got.values()))["ann"]
        cells = []
        for c in names:
            r = got.get(c)
            cells.append("" if r is None else f"{r['snn']:.2f} ({-r['gap']:+.2f})")
        lines.append(f"| `{m}` | {ann:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    """Accuracy of each cell against the ANN, per network (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in CELLS if any(r["cell"] == c for r in rows)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / (len(names) + 1)
    for j, m in enumerate(models):
        got = {r["cell"]: r for r in rows if r["model"] == m}
        ax.bar(j, next(iter(got.values()))["ann"], width, color="k", label="ANN" if j == 0 else None)
        for i, c in enumerate(names):
            if c in got:
                ax.bar(j + (i + 1) * width, got[c]["snn"], width, color=f"C{i}", label=c if j == 0 else None)
    ax.set_xticks([j + 0.4 for j in range(len(models))])
    ax.set_xticklabels(models, fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("edge networks, Fashion-MNIST at 32 px: each conversion against its ANN", fontsize=10)
    ax.set_ylim(0, 100)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=len(names) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(EDGE))
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--convert-images", type=int, default=3072)
    ap.add_argument("--test-images", type=int, default=1000)
    ap.add_argument("--diagnose-images", type=int, default=512)
    ap.add_argument("--chip-images", type=int, default=256, help="test images for the cpu / loihi2-sim cells")
    ap.add_argument("--train-only", action="store_true", help="only train (and cache) the ANNs")
    ap.add_argument("--table", action="store_true", help="only the table and plot of the cells measured")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/snnconv/edge"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "edge"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m benchmarks matrix edge " + " ".join(sys.argv[1:] if argv is None else argv)
    anns_path, cells_path = os.path.join(args.out, "anns.json"), os.path.join(args.out, "cells.json")
    if args.table:
        rows = _read(cells_path)
        print(table(rows))
        plot(rows, os.path.join(args.out, "cells.png"))
        return 0
    anns = _read(anns_path)
    for name in args.models.split(","):
        if not any(r["model"] == name and r["epochs"] == args.epochs for r in anns):
            log(f"{name}: training (or reading the cache)")
            row = ann_row(name, args.epochs, args.cache, 10000)
            log(f"{name}: ANN {row['ann']:.2f}% after {row['train_seconds']:.0f} s")
            anns.append(row)
            _write(anns_path, {"command": command, "rows": anns})
        if args.train_only:
            continue
        for c in args.cells:
            rows = _read(cells_path)
            if any(r["model"] == name and r["cell"] == c and r["seed"] == args.seed for r in rows):
                continue
            log(f"{name}: cell {c}")
            row = cell(name, c, args)
            log(f"{name}: {c}: SNN {row['snn']:.2f}% (ANN {row['ann']:.2f}%) in {row['seconds']:.0f} s")
            rows = _read(cells_path) + [row]
            _write(cells_path, {"command": command, "rows": rows})
            plot(rows, os.path.join(args.out, "cells.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
