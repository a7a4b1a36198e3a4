"""convert()'s time per stage against the forward passes it cannot avoid.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks backends convert_timing --models resnet20 --threads 2
    .venv/bin/python -m benchmarks backends convert_timing --models resnet20 resnet18 --device cuda

For each network (3x32x32 inputs, random weights with BatchNorm statistics set by a few
training-mode passes, Gaussian data: time does not depend on accuracy): ``convert()`` without
QCFS training (10 calibration batches of 128, T=8, bias calibration on its default 4 batches)
with its per-stage times; then the references: 10 ANN forwards of the calibration batches, and
one T-step SNN pass over the bias calibration batches (the cost floor of bias calibration),
bias calibration alone at T, membrane calibration at 2T without and with the weight fit
(convert()'s default for subtractive reset) against a 2T-step pass, and bias calibration by re-running the
network up to each layer
(the slow reference algorithm; ``--skip-rerun`` leaves it out: it grows with the square of the depth). Best of
``--repeat``; ``--T`` another T. Also convert()'s peak memory (CUDA's allocator peak, or the
process's maximum resident set on a CPU). Writes ``results/convert_timing.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import os
import resource
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv import models
from snnconv.calibration.bias import calibrate_bias, calibrate_bias_by_rerun
from snnconv.io.atomic import atomic_write_text

from ..common import RESULTS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, repeat: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(name: str, device: torch.device, *, T: int = 8, batches: int = 10, batch: int = 128,
            repeat: int = 2, rerun: bool = True) -> dict:
    torch.manual_seed(0)
    model = models.get(name, num_classes=10, in_channels=3)
    x = torch.randn(batches * batch, 3, 32, 32)
    y = torch.randint(0, 10, (len(x),))
    model.train()
    with torch.no_grad():
        for i in range(3):
            model(x[i * batch:(i + 1) * batch])  # BatchNorm running statistics of this data
    model.eval()
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    extra = {"on_collapse": "warn"} if "on_collapse" in inspect.signature(snnconv.convert).parameters else {}
    # the calibration path alone: no fine-tuning, no layer-wise reconstruction (both optimiser
    # steps, timed by the budget in meta)
    fields = {f.name for f in dataclasses.fields(snnconv.ConvertConfig)}
    extra.update({k: 0 for k in ("finetune_epochs", "reconstruction_steps") if k in fields})
    result: dict = {"model": name, "T": T, "calibration_batches": batches, "batch": batch,
                    "threads": torch.get_num_threads(), "device": str(device)}
    best_meta = None
    total = float("inf")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        _, meta = snnconv.convert(model, loader, T=T, calib_batches=batches, device=device,
                                  progress=False, **extra)
        _sync(device)
        if time.perf_counter() - t0 < total:
            total, best_meta = time.perf_counter() - t0, meta
    result["convert_seconds"] = total
    # peak memory of convert(): CUDA's allocator peak; on a CPU the process's high-water mark
    # (ru_maxrss: run the largest network first, or one per process, for a per-network figure)
    result["convert_peak_memory_gib"] = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    result["stages"] = {s.name: s.seconds for s in best_meta.stages}
    result["health_check_seconds"] = {s.name: s.changes.get("check_seconds") for s in best_meta.stages
                                      if "check_seconds" in s.changes}
    print("convert", result["convert_seconds"], result["stages"],
          f"peak memory {result['convert_peak_memory_gib']:.2f} GiB", flush=True)
    ann = copy.deepcopy(model).to(device)
    xs = [xb.to(device) for xb, _ in loader]

    def ann_passes():
        with torch.no_grad():
            for xb in xs:
                ann(xb)

    result["ann_forwards_seconds"] = _best(ann_passes, repeat, device)
    print("ann forwards", result["ann_forwards_seconds"], flush=True)
    folded = snnconv.fold_batchnorm(model)
    per_channel = snnconv.ConvertConfig().resolved().per_channel
    qcfs = snnconv.calibrate_qcfs(folded, loader, num_batches=batches, progress=False, device=device,
                                  per_channel=per_channel)
    snn = snnconv.to_spiking(qcfs, T=T).to(device)
    bias_batches = 4
    bx = xs[:bias_batches]

    def snn_pass():  # the network's own forward (cache-sized chunks on a CPU)
        with torch.no_grad():
            for xb in bx:
                snn(xb)

    result["snn_pass_seconds"] = _best(snn_pass, repeat, device)
    print("snn pass", result["snn_pass_seconds"], flush=True)
    result["bias_calibration_seconds"] = _best(lambda: calibrate_bias(snn, qcfs, loader, T=T), repeat, device)
    result["bias_calibration_over_snn_pass"] = result["bias_calibration_seconds"] / result["snn_pass_seconds"]
    print("bias calibration", result["bias_calibration_seconds"], flush=True)
    # convert()'s default for reset="subtract": membrane calibration, one 2T-step pass, with
    # with the weight fit (convert()'s default) and without
    snn.T = 2 * T
    result["snn_pass_2T_seconds"] = _best(snn_pass, repeat, device)
    snn.T = T
    result["membrane_calibration_seconds"] = _best(
        lambda: calibrate_bias(snn, qcfs, loader, T=2 * T, membrane=True), repeat, device)
    weighted = inspect.signature(calibrate_bias).parameters.get("weights") is not None
    if weighted:
        result["membrane_weight_calibration_seconds"] = _best(
            lambda: calibrate_bias(snn, qcfs, loader, T=2 * T, membrane=True, weights=True), repeat, device)
        result["membrane_weight_calibration_over_snn_pass_2T"] = (
            result["membrane_weight_calibration_seconds"] / result["snn_pass_2T_seconds"])
        print("membrane and weight calibration", result["membrane_weight_calibration_seconds"], flush=True)
    result["membrane_calibration_over_snn_pass"] = result["membrane_calibration_seconds"] / result["snn_pass_seconds"]
    result["membrane_calibration_over_snn_pass_2T"] = (result["membrane_calibration_seconds"]
                                                       / result["snn_pass_2T_seconds"])
    print("membrane calibration", result["membrane_calibration_seconds"], flush=True)
    if rerun:
        result["bias_calibration_rerun_seconds"] = _best(
            lambda: calibrate_bias_by_rerun(snn, qcfs, loader, T=T), 1, device)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet20"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--T", type=int, default=8)
    p.add_argument("--skip-rerun", action="store_true")
    p.add_argument("--out", default=os.path.join(RESULTS, "convert_timing.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import json
    import logging

    logging.getLogger("spikingjelly").setLevel(logging.ERROR)
    rows = []
    for name in args.models:
        r = measure(name, torch.device(args.device), T=args.T, repeat=args.repeat, rerun=not args.skip_rerun)
        rows.append(r)
        print(json.dumps(r, indent=1), flush=True)
    atomic_write_text(args.out, json.dumps(rows, indent=1) + "\n")
    print("| network | device | convert() | prepare | fold | qcfs | spiking (to_spiking + bias cal.) | "
          "10 ANN forwards | one T-step SNN pass (4 batches) | bias cal. | bias cal. / SNN pass | "
          "bias cal. before (rerun) | peak memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["stages"]
        print(f"| {r['model']} | {r['device']}, {r['threads']} threads | {r['convert_seconds']:.2f} | "
              f"{s.get('prepare', 0):.2f} | {s.get('fold', 0):.2f} | {s.get('qcfs', 0):.2f} | "
              f"{s.get('spiking', 0):.2f} | {r['ann_forwards_seconds']:.2f} | {r['snn_pass_seconds']:.2f} | "
              f"{r['bias_calibration_seconds']:.2f} | {r['bias_calibration_over_snn_pass']:.2f} | "
              f"{r.get('bias_calibration_rerun_seconds', float('nan')):.1f} | "
              f"{r['convert_peak_memory_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
