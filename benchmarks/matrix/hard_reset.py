"""Hard reset (reset="zero"): conversion-side fixes over three networks and T = 4, 8, 16, 32.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks matrix hard_reset \
        [--nets small_cnn,resnet8,vgg] [--methods ...] [--out benchmarks/results/hard_reset.json]

Networks (scikit-learn digits, 1347 train / 450 test images, the full test split):
``small_cnn`` (the demo SmallCNN, 8x8), ``resnet8`` (snnconv.models.resnet8, widths 16/32/64,
digits upsampled to 16x16) and ``vgg`` (snnconv.models.VGG, 6 convolutions 32-32-P-64-64-P-128-
128-P, 16x16). Each ANN is trained once (15 epochs, seed 0, cached under
benchmarks/results/cache/), QCFS-calibrated once (L=8, per layer, 99.9th percentile), then
converted per method and per T with every calibration at that T (the run T). Methods:

- ``subtract+bias``: the default neuron with bias calibration (the reference row).
- ``zero``: hard reset, no fix. ``zero+bias``: with bias calibration only.
- ``zero+shift`` / ``zero+shift+bias``: per-step bias shift theta/(2T) (calibration.shift_bias).
- ``zero+thr`` / ``zero+thr+bias``: threshold calibration (calibration.calibrate_thresholds:
  per-layer threshold factor and least-squares output scale), then bias calibration.
- ``zero+thrk`` / ``zero+thrk+bias``: the threshold factor alone (``rescale=False``).
- ``zero+thrc+bias``: per-channel threshold factors (``rescale=False``), then bias calibration.
- ``zero+thrc+bias``: per-channel threshold factors, then bias calibration.
- ``zero+thr+bias+ft``: the default, then BPTT fine-tuning (2 epochs, AdamW, lr 1e-3, T=run T).

Single-threaded; a few minutes per network (fine-tuning adds more).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from snnconv.analysis.metrics import evaluate
from snnconv.calibration import calibrate_bias, calibrate_thresholds, shift_bias
from snnconv.data import digits
from snnconv.demo import train_ann
from snnconv.graph import prepare
from snnconv.io.atomic import atomic_write_bytes
from snnconv.models import VGG, resnet8, small_cnn
from snnconv.stages.fold import fold_graph
from snnconv.stages.qcfs import calibrate_qcfs
from snnconv.stages.spiking import to_spiking

from ..common import CACHE, RESULTS

TS = (4, 8, 16, 32)
METHODS = ("subtract+bias", "zero", "zero+bias", "zero+shift", "zero+shift+bias", "zero+thrk", "zero+thrk+bias",
           "zero+thr", "zero+thr+bias", "zero+thrc+bias", "zero+thr+bias+ft")


def _up(ds: TensorDataset, size: int) -> TensorDataset:
    x, y = ds.tensors
    return TensorDataset(F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False), y)


def network(name: str):
    """(ann, train_loader, test_loader) for ``name``; the ANN trained once and cached."""
    train_set, test_set = digits(seed=0)
    if name != "small_cnn":
        train_set, test_set = _up(train_set, 16), _up(test_set, 16)
    build = {"small_cnn": lambda: small_cnn(num_classes=10, in_channels=1),
             "resnet8": lambda: resnet8(num_classes=10, in_channels=1),
             "vgg": lambda: VGG([32, 32, "P", 64, 64, "P", 128, 128, "P"], 10, 1)}[name]
    train = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    test = DataLoader(test_set, batch_size=256)
    torch.manual_seed(0)
    ann = build()
    path = os.path.join(CACHE, f"hard_reset_{name}.pt")
    if os.path.exists(path):
        ann.load_state_dict(torch.load(path, weights_only=True))
        ann.eval()
    else:
        ann = train_ann(ann, train, epochs=15, progress=False)
        os.makedirs(CACHE, exist_ok=True)
        torch.save(ann.state_dict(), path)
    return ann, train, test


def convert_one(qgm, train, method: str, T: int):
    reset = "subtract" if method.startswith("subtract") else "zero"
    snn = to_spiking(qgm, T=T, reset=reset)
    parts = method.split("+")[1:]
    if "shift" in parts:
        snn = shift_bias(snn, T=T)
    if {"thr", "thrc", "thrk"} & set(parts):
        snn = calibrate_thresholds(snn, qgm, train, T=T, per_channel="thrc" in parts,
                                   rescale="thr" in parts)
    if "bias" in parts:
        snn = calibrate_bias(snn, qgm, train, T=T)
    if "ft" in parts:
        from snnconv.stages.finetune import FinetuneConfig, finetune

        cfg = FinetuneConfig(epochs=2, T=T, optimizer="adamw", lr=1e-3, seed=0)
        snn, _ = finetune(snn, train, config=cfg, progress=False)
    snn.T = T
    return snn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default="small_cnn,resnet8,vgg")
    ap.add_argument("--methods", default=",".join(m for m in METHODS if "ft" not in m))
    ap.add_argument("--T", default=",".join(map(str, TS)))
    ap.add_argument("--out", default=os.path.join(RESULTS, "hard_reset.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    Ts = [int(t) for t in args.T.split(",")]
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    for name in args.nets.split(","):
        ann, train, test = network(name)
        gm = prepare(ann)
        fold_graph(gm, (next(iter(train))[0],))
        train.generator.manual_seed(0)  # the same calibration batches whether trained or cached
        qgm = calibrate_qcfs(gm, train, L=8, progress=False)
        row = results.setdefault(name, {})
        row["ann"] = evaluate(ann, test)
        row["qcfs"] = evaluate(qgm, test)
        row["test_images"] = len(test.dataset)
        print(f"{name}: ANN {row['ann']:.2f}%  QCFS-ANN {row['qcfs']:.2f}%", flush=True)
        for method in args.methods.split(","):
            accs, secs = row.setdefault(method, {}), {}
            for T in Ts:
                torch.manual_seed(0)
                start = time.perf_counter()
                snn = convert_one(qgm, train, method, T)
                secs[T] = time.perf_counter() - start
                accs[str(T)] = evaluate(snn, test)
            print(f"  {method:18}" + "".join(f"{accs[str(T)]:8.2f}" for T in Ts)
                  + f"   ({sum(secs.values()):.0f} s)", flush=True)
        row["command"] = ("OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks matrix hard_reset "
                          f"--nets {name}")
        atomic_write_bytes(args.out, json.dumps(results, indent=1, sort_keys=True).encode())


if __name__ == "__main__":
    main()
