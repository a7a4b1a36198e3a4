"""BPTT fine-tuning on Fashion-MNIST: accuracy by T before/after, time, memory.

    .venv/bin/python -m benchmarks matrix finetune          # about 40 min on 2 cores

Starts from the SNN of benchmarks/matrix/accuracy_vs_T.py (results/accuracy_vs_T_snn.pt, converted
with QCFS, no BPTT), fine-tunes it at T=4 and (separately) at T=2 for at most 2 epochs, and
evaluates at T = 1, 2, 4, 8 on the full 10k test set. Then measures the peak memory (RSS of a
fresh process) and step time of one training step at T=4, batch 128, without and with
activation checkpointing, against a plain spikingjelly multi-step network of the same
architecture. Writes results/finetune.json and results/finetune.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.analysis.metrics import accuracy_by_T, evaluate
from snnconv.analysis.plots import plot_accuracy_vs_T
from snnconv.data import split_dataset
from snnconv.stages.finetune import blend

from ..common import RESULTS, child_env, loaders, module_command, trained_ann, write_json

TS = (1, 2, 4, 8)


def _rss_mb() -> float:
    """Peak resident memory of this process (VmHWM; unlike ru_maxrss it is not inherited
    from the parent across fork + exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sj_resnet14():
    """ResNet-14 written with spikingjelly's multi-step layers (the 'plain spikingjelly' peer)."""
    from spikingjelly.activation_based import functional, layer, neuron, surrogate

    def if_node():
        return neuron.IFNode(v_reset=None, surrogate_function=surrogate.ATan(), step_mode="m")

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = layer.Conv2d(cin, cout, 3, stride, 1, step_mode="m")
            self.n1 = if_node()
            self.c2 = layer.Conv2d(cout, cout, 3, 1, 1, step_mode="m")
            self.sc = (layer.Conv2d(cin, cout, 1, stride, step_mode="m")
                       if stride != 1 or cin != cout else nn.Identity())
            self.n2 = if_node()

        def forward(self, x):
            return self.n2(self.c2(self.n1(self.c1(x))) + self.sc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = layer.Conv2d(1, 16, 3, 1, 1, step_mode="m")
            self.n = if_node()
            blocks, c = [], 16
            for i, w in enumerate((16, 32, 64)):
                for j in range(2):
                    blocks.append(Block(c, w, 2 if (i and not j) else 1))
                    c = w
            self.blocks = nn.Sequential(*blocks)
            self.pool = layer.AdaptiveAvgPool2d(1, step_mode="m")
            self.fc = layer.Linear(64, 10, step_mode="m")

        def forward(self, x_seq):
            out = self.pool(self.blocks(self.n(self.stem(x_seq))))
            return self.fc(out.flatten(2))

    net = Net()
    functional.set_step_mode(net, "m")
    return net


def probe(mode: str, T: int, batch: int, steps: int) -> dict:
    """One process, one configuration: step time and peak RSS of BPTT training steps."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    if mode == "spikingjelly":
        from spikingjelly.activation_based import functional

        net = sj_resnet14()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step():
            functional.reset_net(net)
            out = net(x.unsqueeze(0).repeat(T, 1, 1, 1, 1)).mean(0)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        snn = snnconv.SpikingNetwork.load(os.path.join(RESULTS, "accuracy_vs_T_snn.pt"))
        snn.T = T
        from snnconv.stages.finetune import checkpointed

        runner = checkpointed(snn, mode) if mode != "none" else snn
        runner.train()
        opt = torch.optim.AdamW(snn.parameters(), lr=1e-4)

        def step():
            loss = F.cross_entropy(runner(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    base = _rss_mb()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"mode": mode, "T": T, "batch": batch, "step_s_median": statistics.median(times[1:] or times),
            "peak_rss_mb": _rss_mb(), "rss_before_steps_mb": base,
            "peak_rss_increase_mb": _rss_mb() - base}


def _memory() -> list[dict]:
    """Each configuration in a fresh process: its peak memory is its own."""
    out = []
    for mode in ("none", "neuron", "block", "spikingjelly"):
        proc = subprocess.run(module_command("benchmarks.matrix.finetune", "--probe", mode),
                              capture_output=True, text=True, check=True, env=child_env())
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(out[-1], flush=True)
    return out


def converted(ann, train, T: int, progress: bool, L: int = 8, qcfs_epochs: int = 2,
              device="cpu") -> snnconv.SpikingNetwork:
    """convert() at T (per-channel QCFS with L levels, ``qcfs_epochs`` of QCFS training, bias
    calibration at T); cached, with its wall time in ``meta["convert_s"]``."""
    name = f"convert_T{T}" + ("" if (L, qcfs_epochs) == (8, 2) else f"_L{L}_e{qcfs_epochs}")
    path = os.path.join(RESULTS, "cache", f"{name}_snn.pt")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        snn, _ = snnconv.convert(ann, train, T=T, L=L, per_channel=True, qcfs_epochs=qcfs_epochs,
                                 device=device, progress=progress)
        snn = snn.cpu()
        snn.meta["convert_s"] = time.perf_counter() - t0
        snn.save(path)
    return snnconv.SpikingNetwork.load(path)


def choose_wise(start, tuned, grid, at, progress, seed=0, device="cpu"):
    """The WiSE-FT weight with the best mean validation accuracy over the time steps ``at``
    (fine-tuning's own 10% validation split of the training set, never the test set); all of
    T = 2, 4, 8 and ``at`` are recorded."""
    from torch.utils.data import DataLoader

    from snnconv.data import fashion_mnist

    _, val = split_dataset(fashion_mnist(train=True), 0.1, seed=seed)
    val = DataLoader(val, batch_size=500)
    scores = {}
    for w in grid:
        scores[w] = accuracy_by_T(blend(start, tuned, w), val, sorted({2, 4, 8, *at}), device)
        if progress:
            print("WiSE", w, "validation", scores[w])
    return max(grid, key=lambda w: statistics.mean(scores[w][t] for t in at)), scores


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--train-thresholds", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--threshold-lr", type=float, default=None)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of distillation from the ANN (0: cross-entropy only)")
    p.add_argument("--distill-temperature", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0, help="fine-tuning seed (split, order, init)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--no-amp", action="store_true",
                   help="on CUDA: train in float32 without TF32 (as on CPU) instead of autocast")
    p.add_argument("--wise", type=float, nargs="*", default=[],
                   help="WiSE-FT weights of the start to try (e.g. 0 0.1 0.2 0.3): each blend is "
                        "scored on the validation split (mean accuracy at --wise-T), the best is "
                        "evaluated on the test set")
    p.add_argument("--wise-T", type=int, nargs="+", default=None,
                   help="time steps the WiSE weight is chosen for (default: T and 2T, the "
                        "fine-tuning T and the next doubling)")
    p.add_argument("--resume", action="store_true",
                   help="continue (or, when finished, just reload) the run in the checkpoint folder")
    p.add_argument("--augment", action="store_true", help="random horizontal flips while fine-tuning")
    p.add_argument("--convert-T", type=int, default=0,
                   help="start from convert(T=this, per-channel L=8, 2 QCFS epochs, bias "
                        "calibration at this T) instead of the accuracy benchmark's SNN")
    p.add_argument("--convert-L", type=int, default=8, help="QCFS levels of that conversion")
    p.add_argument("--convert-epochs", type=int, default=2, help="QCFS training epochs of that conversion")
    p.add_argument("--alpha", type=float, default=2.0, help="ATan surrogate sharpness")
    p.add_argument("--detach-reset", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--finetune-T", type=int, nargs="+", default=[4, 2])
    p.add_argument("--horizons", type=int, nargs="*", default=[2],
                   help="extra anytime-readout horizons (steps) added to the loss when <= T")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--max-steps", type=int, nargs="*", default=[],
                   help="steps per epoch for each --finetune-T in order (default: all)")
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--eval-T", type=int, nargs="+", default=list(TS), help="time steps evaluated")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-only", action="store_true",
                   help="only (re)measure memory and step time, into the existing finetune.json")
    p.add_argument("--out", default=os.path.join(RESULTS, "finetune"))
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    logging.getLogger("spikingjelly").setLevel(logging.ERROR)
    if args.probe:
        print(json.dumps(probe(args.probe, T=4, batch=128, steps=4)))
        return
    torch.set_num_threads(args.threads)
    progress = not args.quiet
    device = torch.device(args.device)
    if device.type == "cuda" and args.no_amp:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if args.memory_only:
        with open(args.out + ".json") as fh:
            results = json.load(fh)
        results["memory"] = _memory()
        write_json(results, args.out + ".json")
        return

    ann, _ = trained_ann("resnet14", 3, progress=progress)
    train, test = loaders(batch_size=128, augment=args.augment)
    if args.test_limit:
        test = torch.utils.data.DataLoader(torch.utils.data.Subset(test.dataset, range(args.test_limit)),
                                           batch_size=500)
    if args.convert_T:
        # convert() here, bias-calibrated at the fine-tuning T (cached: the same settings give
        # the same network, its wall time is kept with it)
        snn = converted(ann, train, args.convert_T, progress, args.convert_L, args.convert_epochs, device)
        convert_s = snn.meta["convert_s"]
    else:
        snn_path = os.path.join(RESULTS, "accuracy_vs_T_snn.pt")
        if not os.path.exists(snn_path):
            sys.exit(f"{snn_path} missing: run benchmarks/matrix/accuracy_vs_T.py first")
        with open(os.path.join(RESULTS, "accuracy_vs_T.json")) as fh:
            convert_s = json.load(fh)["timing"]["snnconv_pipeline_with_qcfs_training_s"]
        snn = snnconv.SpikingNetwork.load(snn_path)
    results = {"settings": vars(args), "accuracy": {}, "timing": {"convert_s": convert_s}}
    results["accuracy"]["ann"] = evaluate(ann.to(device), test, device)
    results["accuracy"]["before fine-tuning"] = accuracy_by_T(snn.to(device), test, args.eval_T, device)
    print("ANN", results["accuracy"]["ann"], "before", results["accuracy"]["before fine-tuning"])
    for i, T in enumerate(args.finetune_T):
        max_steps = args.max_steps[i] if i < len(args.max_steps) else None
        t0 = time.perf_counter()
        horizons = tuple(sorted({h for h in args.horizons if h < T} | {T})) if args.horizons else None
        if horizons == (T,):
            horizons = None
        tuned, history = snnconv.finetune(
            snn, train, T=T, epochs=args.epochs, lr=args.lr, optimizer=args.optimizer,
            horizons=horizons, warmup_steps=args.warmup, batch_size=args.batch_size,
            train_thresholds=args.train_thresholds, threshold_lr=args.threshold_lr,
            label_smoothing=args.label_smoothing, alpha=args.alpha, detach_reset=args.detach_reset,
            weight_decay=args.weight_decay,
            distill=args.distill, distill_temperature=args.distill_temperature,
            teacher=ann if args.distill else None,
            max_steps_per_epoch=max_steps, resume=args.resume,
            seed=args.seed,
            device=device, amp=not args.no_amp,
            checkpoint_dir=os.path.join(RESULTS, "cache", os.path.basename(args.out) + f"_T{T}"),
            progress=progress)
        seconds = time.perf_counter() - t0
        key = f"fine-tuned at T={T}" + (f" (horizons {horizons})" if horizons else "")
        results["accuracy"][key] = accuracy_by_T(tuned, test, args.eval_T, device)
        results["timing"][f"finetune_T{T}_s"] = seconds
        results["timing"][f"finetune_T{T}_s_per_epoch"] = [h["seconds"] for h in history]
        results["timing"][f"convert_plus_finetune_T{T}_s"] = convert_s + seconds
        results[f"history_T{T}"] = history
        # finetune()'s default 10% validation split, full batches only
        steps = len(split_dataset(train.dataset, 0.1, seed=args.seed)[0]) // args.batch_size
        results["timing"][f"finetune_T{T}_steps_per_epoch"] = min(max_steps or steps, steps)
        print(key, results["accuracy"][key], f"{seconds:.0f} s")
        write_json(results, args.out + ".json")
        if args.wise:
            at = tuple(args.wise_T or (T, 2 * T))
            wise, val_acc = choose_wise(snn, tuned, args.wise, at, progress, args.seed, device)
            results[f"wise_T{T}"] = {"chosen": wise, "val_accuracy": val_acc,
                                     "criterion": f"mean validation accuracy at T={at}"}
            results["accuracy"][f"{key}, WiSE {wise}"] = accuracy_by_T(
                blend(snn, tuned, wise), test, args.eval_T, device)
            print(f"WiSE {wise}", results["accuracy"][f"{key}, WiSE {wise}"])
            plot_accuracy_vs_T({f"WiSE {w}": a for w, a in val_acc.items()},
                               args.out + f"_wise_T{T}.png",
                               title=f"Validation accuracy of (1 - w) * fine-tuned(T={T}) + w * start")
            write_json(results, args.out + ".json")
    results["peak_rss_mb_main_process"] = _rss_mb()
    if not args.skip_memory:
        results["memory"] = _memory()
    write_json(results, args.out + ".json")
    curves = {k: v for k, v in results["accuracy"].items() if isinstance(v, dict)}
    plot_accuracy_vs_T(curves, args.out + ".png", references={"ANN": results["accuracy"]["ann"]},
                       title="Fashion-MNIST ResNet-14 SNN: BPTT fine-tuning")


if __name__ == "__main__":
    main()
