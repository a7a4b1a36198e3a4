"""Bias, membrane and weight calibration variants compared on the robustness nets, run to 64 steps.

    .venv/bin/python -m benchmarks.studies.membrane_calibration --cache CACHE [--archs resnet20 tv_resnet ...]

CACHE is the ANN cache of a robustness sweep (``<out>_cache`` of benchmarks/matrix/robustness.py,
Fashion-MNIST, seed ``--seed`` (0), ``--train-subset`` images; the networks are loaded, never trained
here). For each network: fold, QCFS calibration with convert()'s defaults (L=8, per channel,
percentile 99.9, 10 batches of 128), IF replacement at T=8, then one of

- ``bias@8``: :func:`snnconv.calibration.calibrate_bias` at T=8 (the bias alone),
- ``h4-16``, ``h4-32``: ``calibrate_bias(horizons=(4, 16))`` / ``(4, 32)`` (bias + initial
  membrane per channel, error model a + b/t),
- ``h8-16``, ``h8-32``: the first horizon at the network's T (bias and membrane fitted at both),
- ``h4-16/2b``: (4, 16) on 2 calibration batches instead of 4 (half the cost),
- ``m8``, ``m16``: ``calibrate_bias(T=8 / 16, membrane=True)``: the initial membrane alone
  absorbs the error at that T, the bias only what the membrane's [0, 1] range cannot,
- ``m8w``, ``m16w``: the same with ``weights=True``, each Conv/Linear that reads spikes refitted
  at that T in the same pass (``m16w`` is convert()'s default at T=8),

and the SNN is run once for 64 steps on the first ``--test-limit`` test images; the accuracy
at T is that of the first T steps (nothing in the network depends on T). Writes
results/membrane_calibration.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader

from snnconv.calibration import calibrate_bias
from snnconv.graph import prepare
from snnconv.stages.fold import fold_graph
from snnconv.stages.qcfs import calibrate_qcfs
from snnconv.stages.spiking import to_spiking

from ..common import STUDIES_RESULTS
from ..matrix import anns as R

TS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = {"bias@8": dict(T=8), "h4-16": dict(horizons=(4, 16)), "h4-32": dict(horizons=(4, 32)),
            "h8-16": dict(horizons=(8, 16)), "h8-32": dict(horizons=(8, 32)),
            "h4-16/2b": dict(horizons=(4, 16), num_batches=2),
            "m8": dict(T=8, membrane=True), "m16": dict(T=16, membrane=True),
            "m8w": dict(T=8, membrane=True, weights=True), "m16w": dict(T=16, membrane=True, weights=True)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True)
    ap.add_argument("--archs", nargs="*", default=["resnet20", "tv_resnet", "mobilenet", "small_cnn"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--subset", type=int, default=5000)
    ap.add_argument("--test-limit", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the cached ANN's seed (and the loader's)")
    ap.add_argument("--out", default=os.path.join(STUDIES_RESULTS, "membrane_calibration.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train, test = R.datasets("fmnist", args.subset, args.seed)
    xt, yt = test.tensors[0][:args.test_limit], test.tensors[1][:args.test_limit]
    res = json.load(open(args.out)) if os.path.exists(args.out) else {}
    for arch in args.archs:
        job = dict(dataset="fmnist", arch=arch, epochs=args.epochs, seed=args.seed, subset=args.subset,
                   smoke=False, cache=args.cache)
        ann, cached = R.cached_ann(job, train, torch.device("cpu"))
        if not cached:
            raise SystemExit(f"{arch}: no cached ANN under {args.cache}; run benchmarks/matrix/robustness.py first")
        loader = DataLoader(train, batch_size=128, shuffle=True,
                            generator=torch.Generator().manual_seed(args.seed))
        gm = prepare(ann)
        fold_graph(gm, (next(iter(loader))[0],))
        qgm = calibrate_qcfs(gm, loader, L=8, percentile=99.9, per_channel=True, num_batches=10,
                             maxpool="avg", progress=False)
        with torch.no_grad():
            ann_acc = float((ann(xt).argmax(1) == yt).float().mean()) * 100
            q_acc = float((qgm(xt).argmax(1) == yt).float().mean()) * 100
        for name in args.variants:
            kw = VARIANTS[name]
            key = f"{arch}-e{args.epochs}" + (f"-s{args.seed}" if args.seed else "") + f"/{name}"
            if key in res:
                continue
            t0 = time.perf_counter()
            snn = calibrate_bias(to_spiking(qgm, T=8), qgm, loader, **kw)
            seconds = time.perf_counter() - t0
            snn.T = max(TS)
            correct = torch.zeros(max(TS))
            with torch.no_grad():
                for i in range(0, len(xt), 250):
                    steps = snn(xt[i:i + 250], per_step=True)
                    correct += (steps.cumsum(0).argmax(2) == yt[i:i + 250][None]).sum(1).float()
            acc = (correct / len(xt) * 100).tolist()
            res[key] = {"ann": ann_acc, "qcfs": q_acc, "snn": {t: acc[t - 1] for t in TS},
                        "calibration_seconds": seconds}
            print(key, " ".join(f"{t}:{acc[t - 1]:.1f}" for t in TS), f"({seconds:.0f} s)", flush=True)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    print("\n| network | calibration | ANN | " + " | ".join(f"T={t}" for t in TS) + " | seconds |")
    print("|---|---|---|" + "---|" * len(TS) + "---|")
    for key, r in res.items():
        arch, name = key.split("/")
        snn = {int(t): a for t, a in r["snn"].items()}  # int keys in memory, str after JSON
        print(f"| {arch} | {name} | {r['ann']:.1f} | "
              + " | ".join(f"{snn[t]:.1f}" if t in snn else "" for t in TS)
              + f" | {r['calibration_seconds']:.0f} |")


if __name__ == "__main__":
    main()
