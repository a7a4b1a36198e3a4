"""Accuracy vs T on Fashion-MNIST: snnconv against spikingjelly 2.0's converters, same ANN.

    .venv/bin/python -m benchmarks matrix accuracy_vs_T            # full 10k test set, about 30 min
    .venv/bin/python -m benchmarks matrix accuracy_vs_T --reset subtract   # without the hard-reset row

Trains (or loads from results/cache) a BN ResNet-14, converts it with snnconv (QCFS, at most
2 epochs of QCFS training, no BPTT) and with spikingjelly's RateCodingRecipe ('max', '99.9%')
and LocalThresholdBalancingRecipe, and evaluates all of them at T = 1, 2, 4, 8, 16, 32 on the
full test set. Also times convert() against spikingjelly's converter on the same calibration
batches, and one SNN forward at T=8 against 8 ANN forwards. ``--reset both`` (the default) adds
a row for the same QCFS-ANN converted with hard-reset neurons (``reset="zero"``, v[0] = 0), next
to snnconv's subtractive reset. Writes results/accuracy_vs_T.json and results/accuracy_vs_T.png.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import os
import statistics
import time

import torch

import snnconv
from snnconv.analysis.metrics import accuracy_by_T, evaluate
from snnconv.analysis.plots import plot_accuracy_vs_T
from snnconv.calibration import calibrate_bias

from ..common import RESULTS, loaders, trained_ann, write_json

TS = (1, 2, 4, 8, 16, 32)


def sj_accuracy_by_T(net, loader, Ts, progress=True):
    """spikingjelly's own evaluation loop: single-step, reset_net per batch, cumulative readout."""
    from spikingjelly.activation_based import functional

    from snnconv.progress import progress_bar

    T_max = max(Ts)
    correct = {t: 0 for t in Ts}
    total = 0
    net.eval()
    with torch.no_grad():
        for x, y in progress_bar(loader, desc="spikingjelly eval", disable=not progress, leave=False):
            functional.reset_net(net)
            out = 0
            for t in range(1, T_max + 1):
                out = out + net(x)
                if t in correct:
                    correct[t] += (out.argmax(1) == y).sum().item()
            total += len(y)
    return {t: 100.0 * c / total for t, c in correct.items()}


def sj_convert(ann, recipe_name, calib):
    from spikingjelly.activation_based import ann2snn

    if recipe_name == "ltb":
        recipe = ann2snn.LocalThresholdBalancingRecipe(dataloader=calib)
    else:
        recipe = ann2snn.RateCodingRecipe(dataloader=calib, mode=recipe_name)
    t0 = time.perf_counter()
    net = ann2snn.FXConverter(recipe=recipe, device="cpu").convert(copy.deepcopy(ann))
    return net, time.perf_counter() - t0


def median_time(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet14")
    p.add_argument("--ann-epochs", type=int, default=3)
    p.add_argument("--L", type=int, default=8)
    p.add_argument("--qcfs-epochs", type=int, default=2)
    p.add_argument("--qcfs-lr", type=float, default=0.01)
    p.add_argument("--qcfs-optimizer", default="sgd")
    p.add_argument("--lambda-lr", type=float, default=None)
    p.add_argument("--per-channel", action="store_true")
    p.add_argument("--percentile", type=float, default=99.9)
    p.add_argument("--calib-batches", type=int, default=10)
    p.add_argument("--bias-calibration-T", type=int, default=0,
                   help="shift biases to match the QCFS-ANN at this T (0: off)")
    p.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test images only")
    p.add_argument("--per-T-calibration", action="store_true",
                   help="also report an SNN bias-calibrated at each evaluated T")
    p.add_argument("--reset", choices=("subtract", "zero", "both"), default="both",
                   help="neuron reset of the snnconv rows: subtraction (v[0] = theta/2), to zero "
                        "(hard reset, v[0] = 0), or both side by side")
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(RESULTS, "accuracy_vs_T"))
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("spikingjelly").setLevel(logging.ERROR)
    progress = not args.quiet

    ann, ann_info = trained_ann(args.model, args.ann_epochs, progress=progress)
    train, test = loaders(batch_size=128)
    if args.test_limit:
        sub = torch.utils.data.Subset(test.dataset, range(args.test_limit))
        test = torch.utils.data.DataLoader(sub, batch_size=500)
    results = {"model": args.model, "ann_train": ann_info, "settings": vars(args),
               "test_images": len(test.dataset), "accuracy": {}, "timing": {}}
    results["accuracy"]["ann"] = evaluate(ann, test)
    print(f"ANN: {results['accuracy']['ann']:.2f}%")

    calib = list(itertools.islice(iter(torch.utils.data.DataLoader(
        train.dataset, batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(1))),
        args.calib_batches))

    # snnconv: calibration only (timed against spikingjelly on the same batches) ...
    t0 = time.perf_counter()
    snnconv.convert(ann, calib, T=8, L=args.L, percentile=args.percentile, per_channel=args.per_channel,
                    calib_batches=args.calib_batches, progress=False)
    results["timing"]["snnconv_convert_calibration_only_s"] = time.perf_counter() - t0

    # ... and the full pipeline with QCFS training, stage by stage (exactly what convert() runs)
    # so that the QCFS-ANN stays at hand for the per-T bias calibration below
    qcfs_cfg = None
    if args.qcfs_epochs:
        qcfs_cfg = snnconv.QCFSTrainConfig(epochs=args.qcfs_epochs, optimizer=args.qcfs_optimizer,
                                           lr=args.qcfs_lr, lambda_lr=args.lambda_lr)
    t0 = time.perf_counter()
    folded = snnconv.fold_batchnorm(ann)
    qcfs = snnconv.calibrate_qcfs(folded, train, L=args.L, percentile=args.percentile,
                                  per_channel=args.per_channel, num_batches=args.calib_batches,
                                  train=qcfs_cfg, progress=progress)
    resets = ("subtract", "zero") if args.reset == "both" else (args.reset,)
    snns = {}
    for reset in resets:
        snns[reset] = snnconv.to_spiking(qcfs, T=8, reset=reset)
        if args.bias_calibration_T:
            snns[reset] = calibrate_bias(snns[reset], qcfs, train, T=args.bias_calibration_T)
    snn = snns[resets[0]]
    results["timing"]["snnconv_pipeline_with_qcfs_training_s"] = time.perf_counter() - t0
    results["qcfs_history"] = qcfs.meta["qcfs"].get("history", [])
    results["accuracy"]["qcfs-ann"] = evaluate(qcfs, test)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for reset, net in snns.items():
        label = "snnconv" if reset == "subtract" else "snnconv hard reset"
        if args.bias_calibration_T:
            label += f" (bias calibrated at T={args.bias_calibration_T})"
        acc = accuracy_by_T(net, _progress(test, progress, f"{label} eval"), TS)
        results["accuracy"][label] = acc
        print(label, {t: round(a, 2) for t, a in acc.items()}, flush=True)
        net.save(args.out + ("_snn.pt" if reset == "subtract" else "_snn_hard.pt"))
        write_json(results, args.out + ".json")
    if args.per_T_calibration:
        for reset in resets:
            plain = snnconv.to_spiking(qcfs, T=8, reset=reset)
            name = "snnconv" if reset == "subtract" else "snnconv hard reset"
            per_T = {}
            for T in TS:
                tuned = calibrate_bias(plain, qcfs, train, T=T)
                per_T[T] = accuracy_by_T(tuned, test, [T])[T]
                print(f"{name} calibrated at T={T}: {per_T[T]:.2f}", flush=True)
            results["accuracy"][f"{name} (bias calibrated at each T)"] = per_T
            write_json(results, args.out + ".json")

    # cost of one SNN forward at T=8 against 8 ANN forwards on the same batch of 256
    x = next(iter(torch.utils.data.DataLoader(test.dataset, batch_size=256)))[0]
    folded = snnconv.fold_batchnorm(ann)
    with torch.no_grad():
        snn.T = 8
        t_snn = median_time(lambda: snn(x))
        t_ann = median_time(lambda: [folded(x) for _ in range(8)])
    results["timing"]["snn_T8_over_8_ann_forwards"] = t_snn / t_ann
    results["timing"]["snn_T8_forward_s"] = t_snn
    results["timing"]["ann_8_forwards_s"] = t_ann

    if not args.skip_peers:
        for name, label in (("max", "spikingjelly RateCoding max"),
                            ("99.9%", "spikingjelly RateCoding 99.9%"),
                            ("ltb", "spikingjelly LocalThresholdBalancing")):
            net, seconds = sj_convert(ann, name, calib)
            results["timing"][f"{label} convert_s"] = seconds
            results["accuracy"][label] = sj_accuracy_by_T(net, test, TS, progress)
            print(label, {t: round(a, 2) for t, a in results["accuracy"][label].items()})
            if name == "99.9%":
                with torch.no_grad():
                    from spikingjelly.activation_based import functional

                    def sj_forward(net=net):
                        functional.reset_net(net)
                        for _ in range(8):
                            net(x)
                    results["timing"]["spikingjelly_T8_over_8_ann_forwards"] = median_time(sj_forward) / t_ann

    write_json(results, args.out + ".json")
    curves = {k: v for k, v in results["accuracy"].items() if isinstance(v, dict)}
    plot_accuracy_vs_T(curves, args.out + ".png", references={"ANN": results["accuracy"]["ann"]},
                       title=f"Fashion-MNIST {args.model}: accuracy vs T ({len(test.dataset)} test images)")
    print(_table(results))


def _progress(loader, progress, desc):
    from snnconv.progress import progress_bar

    class _L:
        def __iter__(self):
            return iter(progress_bar(loader, desc=desc, disable=not progress, leave=False))
    return _L()


def _table(results):
    rows = [f"{'method':52}" + "".join(f"{f'T={t}':>8}" for t in TS)]
    for name, acc in results["accuracy"].items():
        if isinstance(acc, dict):
            rows.append(f"{name:52}" + "".join(f"{acc[t]:8.2f}" for t in TS))
        else:
            rows.append(f"{name:52}{acc:8.2f} (ANN)")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
