"""QCFS training's targets: the labels, or the ANN's outputs at a distillation temperature.

    .venv/bin/python -m benchmarks.studies.qcfs_distill --cache CACHE [--archs resnet20 small_cnn ...]

CACHE is the ANN cache of a robustness sweep (``<out>_cache`` of benchmarks/matrix/robustness.py,
Fashion-MNIST, ``--train-subset`` images, seed ``--seed``; loaded, never trained here). Each
folded ANN is QCFS-calibrated at L = 4 (per channel) and trained ``--epochs`` epochs with
``QCFSTrainConfig``'s defaults (SGD, lr 0.01), once from the labels and once distilled from
the ANN alone at each temperature of ``--temperatures`` (the loss scales the distillation term
by the temperature squared). Prints and writes, per run: validation accuracy after each epoch
(agreement with the ANN where distilled), the epoch kept (0: the calibrated network) and the
QCFS-ANN's accuracy on the first ``--images`` test images. Writes results/qcfs_distill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from snnconv import QCFSTrainConfig, calibrate_qcfs, fold_batchnorm
from snnconv.analysis.metrics import evaluate
from snnconv.io.atomic import atomic_write_text

from ..common import STUDIES_RESULTS
from ..matrix import anns as R


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True)
    ap.add_argument("--archs", nargs="*", default=["resnet20", "small_cnn"])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="*", default=[2.0, 1.0])
    ap.add_argument("--train-subset", type=int, default=5000)
    ap.add_argument("--ann-epochs", type=int, default=10, help="the cached ANN's training epochs")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the cached ANN's seed (and the loader's)")
    ap.add_argument("--out", default=os.path.join(STUDIES_RESULTS, "qcfs_distill.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train, test_set = R.datasets("fmnist", args.train_subset, args.seed)
    test = DataLoader(TensorDataset(*(t[:args.images] for t in test_set.tensors)), batch_size=250)
    res = json.load(open(args.out)) if os.path.exists(args.out) else {}
    runs = [("labels", 0.0, 1.0)] + [(f"distilled, temperature {t:g}", 1.0, t) for t in args.temperatures]
    for arch in args.archs:
        key = f"{arch}-s{args.seed}"
        job = dict(dataset="fmnist", arch=arch, epochs=args.ann_epochs, seed=args.seed,
                   subset=args.train_subset, smoke=False, cache=args.cache)
        ann, cached = R.cached_ann(job, train, torch.device("cpu"))
        if not cached:
            raise SystemExit(f"{arch}: no cached ANN under {args.cache}; run benchmarks/matrix/robustness.py first")
        folded = fold_batchnorm(ann)
        for name, distill, temperature in runs:
            if name in res.get(key, {}):
                continue
            loader = DataLoader(train, batch_size=128, shuffle=True,
                                generator=torch.Generator().manual_seed(args.seed))
            cfg = QCFSTrainConfig(epochs=args.epochs, seed=args.seed, distill=distill,
                                  distill_temperature=temperature)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = calibrate_qcfs(folded, loader, L=4, per_channel=True, progress=False, train=cfg,
                                   teacher=ann if distill else None)
            meta = q.meta["qcfs"]
            out = {"val_acc": [h["val_acc"] for h in meta["history"]],
                   "calibrated_val_acc": meta["calibrated_val_acc"], "best_epoch": meta["best_epoch"],
                   "test_acc": evaluate(q, test, "cpu"), "seconds": time.perf_counter() - t0}
            res.setdefault(key, {})[name] = out
            print(f"{key} {name}: validation {meta['calibrated_val_acc']:.1f} -> "
                  f"{', '.join(f'{v:.1f}' for v in out['val_acc'])}, kept epoch {out['best_epoch']}, "
                  f"QCFS-ANN {out['test_acc']:.2f}% on {args.images} test images", flush=True)
            atomic_write_text(args.out, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
