"""Speed of the backends against the ANN: image-steps per second and the cost of T ANN forwards.

For each network (CIFAR shape 3x32x32, random BN statistics, converted on random data: the
speed does not depend on what the weights learned, only on their shapes and the spike
density, which is reported) and each T, in one process on the same batch:

- ``ann``: the BatchNorm-folded ReLU network, T forwards (the dense limit of an SNN step);
- ``torch_snn``: snnconv's ``SpikingNetwork`` (chunked, time folded into the batch);
- ``cpu``: the cpu backend on the exported NIR graph (in-place neuron loop);
- ``cpu_compiled``: the same with ``neuron="compiled"`` (one fused kernel per neuron layer;
  compilation time reported apart, excluded from the timing);
- ``spikingjelly``: spikingjelly 2.0's ``FXConverter(RateCodingRecipe("max"))`` network,
  stepped T times in single-step mode.

``ratio`` = time / (T x one ANN forward): 1.0 is the dense limit. ``--clock cpu`` measures the
process's CPU time instead of wall time: on a machine shared with other jobs, use it with
``--threads 1`` (the CPU time of one thread is the work done, whatever the load). ``--crossover`` also measures
at which spike density an event-driven conv (one scatter per spike) would beat the dense one.

    python -m benchmarks backends speed --threads 2            # ResNet-20 and ResNet-18, T = 4 and 8
    python -m benchmarks backends speed --models resnet20 --T 8 --batch 128 --crossover
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

import snnconv
from snnconv import models
from snnconv.io.atomic import atomic_write_text
from snnconv.snn.nir_io import export_nir
from snnconv.stages.fold import fold_batchnorm

from ..common import RESULTS, randomise_bn

SHAPE = (3, 32, 32)




def build(name: str, T: int, seed: int = 0):
    """(BN model, folded ANN, SpikingNetwork) for zoo network ``name`` on random data."""
    torch.manual_seed(seed)
    model = randomise_bn(models.get(name, num_classes=10, in_channels=SHAPE[0]), seed)
    calib = torch.rand(32, *SHAPE, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    snn, _ = snnconv.convert(copy.deepcopy(model), [(calib, torch.zeros(32, dtype=torch.long))], T=T,
                             calib_batches=1, bias_calibration=False, progress=False)
    return model, fold_batchnorm(model, calib[:2]).eval(), snn, calib


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (oneDNN primitives, allocator)
    best = float("inf")
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def spikingjelly_net(model: torch.nn.Module, calib: torch.Tensor):
    from spikingjelly.activation_based import ann2snn

    recipe = ann2snn.RateCodingRecipe(dataloader=[(calib, torch.zeros(len(calib)))], mode="max")
    return ann2snn.FXConverter(recipe=recipe, device="cpu").convert(copy.deepcopy(model)).eval()


def run_sj(net: torch.nn.Module, x: torch.Tensor, T: int) -> torch.Tensor:
    from spikingjelly.activation_based import functional

    functional.reset_net(net)
    out = 0
    for _ in range(T):
        out = out + net(x)
    functional.reset_net(net)
    return out / T


CLOCK = time.perf_counter


def interleaved(methods: dict, repeats: int) -> dict[str, float]:
    """Best time of each method over ``repeats`` rounds, the methods taking turns within a round
    (so that a change in machine load hits every method alike)."""
    for fn in methods.values():
        fn()  # warm-up (oneDNN primitives, allocator, compilation)
    best = {name: float("inf") for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = CLOCK()
            fn()
            best[name] = min(best[name], CLOCK() - t0)
    return best


def measure(name: str, T: int, batch: int, repeats: int, compiled: bool, peers: bool) -> dict:
    model, ann, snn, calib = build(name, T)
    x = torch.rand(batch, *SHAPE, generator=torch.Generator().manual_seed(1)) * 2 - 1
    graph = export_nir(snn, input_shape=SHAPE)
    cpu = snnconv.backends.get("cpu").compile(graph)
    methods = {"ann": lambda: [ann(x) for _ in range(T)], "torch_snn": lambda: snn(x),
               "cpu": lambda: cpu.run(x, T)}
    extra: dict[str, dict] = {"cpu": {}}
    with torch.no_grad():
        result = cpu.run(x, T)
        extra["cpu"]["bit_identical_to_torch_snn"] = torch.equal(result.outputs, snn.run(x, T))
        if compiled:
            fused = snnconv.backends.get("cpu").compile(graph, neuron="compiled")
            t0 = time.perf_counter()
            warm = fused.run(x, T)
            extra["cpu_compiled"] = {"first_call_seconds": time.perf_counter() - t0,
                                     "bit_identical_to_torch_snn": torch.equal(warm.outputs, result.outputs)}
            methods["cpu_compiled"] = lambda: fused.run(x, T)
        if peers:
            net = spikingjelly_net(model, calib)
            methods["spikingjelly"] = lambda: run_sj(net, x, T)
        times = interleaved(methods, repeats)
    t_ann = times["ann"]
    rows = {}
    for method, seconds in times.items():
        rows[method] = {"seconds": seconds, "image_steps_per_s": batch * T / seconds,
                        "ratio_to_T_ann": seconds / t_ann, **extra.get(method, {})}
    neurons = sum(float(c.sum()) for c in result.spikes.values())
    sizes = {op.name: op.out_shape for op in cpu.bound.ops if op.kind == "neuron"}
    units = sum(torch.Size(s).numel() for s in sizes.values()) * batch * T
    synops, macs = sum(result.synops.values()), sum(result.macs.values())
    return {"model": name, "T": T, "batch": batch, "rows": rows,
            "spike_rate": neurons / units, "synops_per_image": synops / batch,
            "ann_macs_per_image": macs / batch}


def crossover(batch: int, repeats: int, T: int = 8) -> dict:
    """Dense conv vs an event-driven one (one scatter of the weight column per input spike) on a
    ResNet-20 stage-2 layer (32 -> 32 channels, 16x16), over spike densities."""
    cin = cout = 32
    hw = 16
    w = torch.randn(cout, cin, 3, 3)
    n = batch * T
    out = []

    def event_conv(s: torch.Tensor) -> torch.Tensor:
        # scatter-add each spike's 3x3xCout weights into a padded output
        y = torch.zeros(n, hw + 2, hw + 2, cout)
        b, c, i, j = s.nonzero(as_tuple=True)
        flat = y.view(-1, cout)
        for di in range(3):
            for dj in range(3):
                # spike at (i, j) reaches output (i + 1 - di, j + 1 - dj) in padded coordinates
                idx = (b * (hw + 2) + (i + 2 - di)) * (hw + 2) + (j + 2 - dj)
                flat.index_add_(0, idx, w[:, c, di, dj].t())
        return y[:, 1:-1, 1:-1].permute(0, 3, 1, 2)

    with torch.no_grad():
        for density in (0.001, 0.003, 0.01, 0.03, 0.1, 0.2):
            s = (torch.rand(n, cin, hw, hw) < density).float()
            dense = best_time(lambda s=s: F.conv2d(s, w, None, 1, 1), repeats)
            event = best_time(lambda s=s: event_conv(s), repeats)
            err = float((event_conv(s) - F.conv2d(s, w, None, 1, 1)).abs().max())
            out.append({"density": density, "dense_s": dense, "event_s": event,
                        "event_over_dense": event / dense, "max_abs_diff": err})
    wins = [r["density"] for r in out if r["event_s"] < r["dense_s"]]
    return {"layer": "conv3x3 32->32 @16x16", "images_x_steps": n, "points": out,
            "event_driven_wins_below_density": max(wins) if wins else None}


def table(results: list[dict]) -> str:
    lines = ["| model | T | batch | spike rate | ANN x T (s) | method | s | image-steps/s | x ANN |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ann = r["rows"]["ann"]["seconds"]
        for method, row in r["rows"].items():
            lines.append(f"| {r['model']} | {r['T']} | {r['batch']} | {r['spike_rate']:.3f} | {ann:.3f} | "
                         f"{method} | {row['seconds']:.3f} | {row['image_steps_per_s']:.0f} | "
                         f"{row['ratio_to_T_ann']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["resnet20", "resnet18"])
    p.add_argument("--T", nargs="+", type=int, default=[4, 8])
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (default: 128 for resnet20, 32 for resnet18)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="best of this many timed runs")
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile row")
    p.add_argument("--no-peers", action="store_true", help="skip spikingjelly")
    p.add_argument("--crossover", action="store_true", help="also measure dense vs event-driven")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (robust to other jobs at --threads 1)")
    p.add_argument("--out", default=os.path.join(RESULTS, "backends.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    load_before = os.getloadavg()
    results = []
    for name in args.models:
        batch = args.batch or (32 if name == "resnet18" else 128)
        for T in args.T:
            r = measure(name, T, batch, args.repeats, not args.no_compiled, not args.no_peers)
            results.append(r)
            print("\n".join(table([r]).splitlines()[2:]), flush=True)
    report = {"results": results, "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "command": " ".join(["python -m benchmarks backends speed"]
                                  + (argv if argv is not None else sys.argv[1:]))}
    if args.crossover:
        report["crossover"] = crossover(args.batch or 32, args.repeats)
        print(json.dumps(report["crossover"], indent=1))
    print()
    print(table(results))
    print(f"load average before {load_before}, after {report['load_average_after']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
