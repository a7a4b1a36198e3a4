"""``maxpool="auto"`` (analog prefix up to the first max-pooling, average pooling after it)
against ``maxpool="avg"`` (every max-pooling made average pooling) on the matrix's VGG.

The robustness matrix's ``vgg_max`` (Fashion-MNIST, 5,000 training images, trained 2 epochs),
converted with ``convert(model, loader, T=4)`` and each ``maxpool`` mode, accuracy at T = 2, 4, 8
on the first 2,000 test images. Writes ``benchmarks/results/maxpool_modes.json``.

    python -m benchmarks.studies.maxpool_modes [--seeds 1] [--epochs 2]
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
from snnconv.io.atomic import atomic_write_bytes

from ..common import STUDIES_RESULTS as RESULTS
from ..matrix.anns import build, datasets, train_ann


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--test", type=int, default=2000)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for seed in range(args.seeds):
        train, test = datasets("fmnist", 5000, seed)
        model = train_ann(build("vgg_max", "fmnist"), train, args.epochs, seed, torch.device("cpu"))
        loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed))
        test_loader = DataLoader(Subset(test, range(args.test)), batch_size=256)
        ann = snnconv.analysis.metrics.evaluate(model, test_loader, "cpu")
        for mode in ("auto", "avg"):
            start = time.perf_counter()
            snn, meta = snnconv.convert(model, loader, T=4, maxpool=mode, seed=seed, progress=False,
                                        eval_loader=test_loader, eval_T=(2, 8))
            rows.append({"seed": seed, "maxpool": mode, "ann": ann, "qcfs_epochs": meta.settings["qcfs_epochs"],
                         "snn": meta.accuracy["snn"], "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    payload = {"command": "python -m benchmarks.studies.maxpool_modes " + " ".join(argv or sys.argv[1:]), "rows": rows}
    atomic_write_bytes(os.path.join(RESULTS, "maxpool_modes.json"), json.dumps(payload, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
