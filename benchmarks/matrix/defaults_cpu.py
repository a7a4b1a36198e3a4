"""Conversion settings compared across several small networks on CPU (evidence for defaults).

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks matrix defaults_cpu --out benchmarks/results/defaults_cpu.json

The architectures of benchmarks/matrix/robustness.py (``small_cnn``, ``tv_resnet``, ``mobilenet``,
``resnet20``, ``vgg_max`` at reduced width) trained on scikit-learn's digits for ``--epochs``
with two seeds, each converted with every settings variant below (everything else at
convert()'s defaults); accuracy on the 450 test digits at T = 2, 4, 8, 16, 32 and the gap to
the ANN. Prints a table of the mean and worst gap per variant over all networks and seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.io.atomic import atomic_write_text

from ..common import RESULTS
from . import anns as rb

TS = (2, 4, 8, 16, 32)
VARIANTS = {
    "defaults": {},
    "per_channel": {"per_channel": True},
    "per_channel+L4": {"per_channel": True, "L": 4},
    "per_channel+p99.99": {"per_channel": True, "percentile": 99.99},
    "per_channel+biasT16": {"per_channel": True, "bias_calibration_T": 16},
    "per_channel+no_bias": {"per_channel": True, "bias_calibration": False},
    "per_layer+biasT16": {"bias_calibration_T": 16},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--archs", nargs="+", default=["small_cnn", "tv_resnet", "mobilenet", "resnet20", "vgg_max"])
    p.add_argument("--epochs", type=int, nargs="+", default=[3, 15])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--out", default=os.path.join(RESULTS, "defaults_cpu.json"))
    args = p.parse_args(argv)
    import logging

    logging.getLogger("spikingjelly").setLevel(logging.ERROR)
    train, test_set = rb.datasets("digits", None, 0)
    test = DataLoader(test_set, batch_size=450)
    rows = []
    for arch in args.archs:
        for epochs in args.epochs:
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                ann = rb.train_ann(rb.build(arch, "digits", smoke=True), train, epochs, seed, torch.device("cpu"))
                for variant in args.variants:
                    loader = DataLoader(train, batch_size=128, shuffle=True,
                                        generator=torch.Generator().manual_seed(seed))
                    options = dict(VARIANTS[variant])
                    if arch == "vgg_max":
                        options["maxpool"] = "avg"
                    t0 = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        try:
                            _, meta = snnconv.convert(ann, loader, eval_loader=test, eval_T=TS, seed=seed,
                                                      progress=False, on_collapse="warn", **options)
                        except TypeError:  # a convert() without on_collapse
                            _, meta = snnconv.convert(ann, loader, eval_loader=test, eval_T=TS, seed=seed,
                                                      progress=False, **options)
                    acc = meta.accuracy
                    row = {"arch": arch, "epochs": epochs, "seed": seed, "variant": variant,
                           "ann": acc["ann"], "qcfs": acc["qcfs"],
                           "snn": {int(t): a for t, a in acc["snn"].items()},
                           "seconds": time.perf_counter() - t0}
                    rows.append(row)
                    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                      if k != "snn"}), {t: round(a, 1) for t, a in row["snn"].items()}, flush=True)
                atomic_write_text(args.out, json.dumps(rows, indent=1) + "\n")
    print("\n| variant | QCFS-ANN gap | " + " | ".join(f"gap T={t} mean (worst)" for t in TS) + " |")
    print("|---|---|" + "---|" * len(TS))
    for variant in args.variants:
        rs = [r for r in rows if r["variant"] == variant]
        q = [r["ann"] - r["qcfs"] for r in rs]
        cells = []
        for t in TS:
            g = [r["ann"] - r["snn"][t] for r in rs]
            cells.append(f"{statistics.fmean(g):.2f} ({max(g):.2f})")
        print(f"| {variant} | {statistics.fmean(q):.2f} ({max(q):.2f}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
