"""Throughput of loihi2-sim against the float SNN (cpu) and Lava, on ResNet-14 for 1x28x28 inputs.

    python -m benchmarks backends loihi2_speed --T 8 --batch 256 --threads 2 [--lava 2]

The network is converted from a freshly initialised ResNet-14 (width 16) calibrated on random
images: throughput does not depend on training (the float convolutions run densely on 0/1
spikes either way). Prints image-steps per second (best of ``--repeats``); with ``--lava N``
also the Lava reference on N images. ``--cpu-backend`` times the registry's ``cpu`` backend
when it is installed, else the torch SpikingNetwork (the executor ``cpu`` is bit-identical to).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import snnconv
from snnconv.models import resnet14
from snnconv.snn.nir_io import export_nir


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reset", default="subtract", choices=["subtract", "zero"])
    ap.add_argument("--lava", type=int, default=0, help="also run Lava on this many images")
    ap.add_argument("--device", default="cpu", help="device for loihi2-sim (cpu or cuda)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    calib = TensorDataset(torch.randn(512, 1, 28, 28), torch.zeros(512, dtype=torch.long))
    snn, _ = snnconv.convert(resnet14(in_channels=1).eval(), DataLoader(calib, batch_size=128),
                             T=args.T, reset=args.reset, per_channel=args.reset == "subtract", progress=False,
                             bias_calibration=False)
    graph = export_nir(snn)
    x = torch.randn(args.batch, 1, 28, 28)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"threads {args.threads}; batch {args.batch}; T {args.T}; reset {args.reset}")
    steps = args.batch * args.T
    ref = "gpu" if args.device.startswith("cuda") else "cpu"
    try:
        cpu = snnconv.backends.get(ref).compile(graph)
        run_cpu, label = (lambda: cpu.run(x, args.T)), f"{ref} backend"
    except snnconv.BackendError:
        run_cpu, label = (lambda: snn.run(x, args.T)), "torch SpikingNetwork (cpu reference)"
    with torch.no_grad():
        run_cpu()  # warm-up (CUDA kernels, caches)
        t_cpu = best(run_cpu, args.repeats)
    print(f"{label:<40} {steps / t_cpu:10.0f} image-steps/s ({t_cpu:.2f} s)")
    from snnconv_backends.loihi2 import Loihi2SimBackend

    t0 = time.perf_counter()
    prog = Loihi2SimBackend().compile(graph, device=args.device)
    print(f"loihi2-sim compile (quantisation)        {time.perf_counter() - t0:.2f} s")
    xs = x.to(args.device)
    prog.run(xs, args.T)  # warm-up
    t_sim = best(lambda: prog.run(xs, args.T), args.repeats)
    print(f"{'loihi2-sim on ' + args.device:<40} {steps / t_sim:10.0f} image-steps/s ({t_sim:.2f} s); "
          f"ratio to {ref} {t_cpu / t_sim:.2f}")
    if args.lava:
        from snnconv_backends.lava import LavaBackend

        t0 = time.perf_counter()
        res = LavaBackend().compile(graph, max_memory_gb=4).run(x[:args.lava], args.T)
        t = time.perf_counter() - t0
        info = res.extra["lava"]
        print(f"{'lava (' + str(args.lava) + ' images)':<40} {args.lava * args.T / t:10.2f} image-steps/s "
              f"({t:.1f} s wall, Lava run {info['run_seconds']:.1f} s for {info['steps']} steps)")
        ref = prog.run(x[:args.lava], args.T)
        print("lava == loihi2-sim (readout, every step):", torch.equal(ref.outputs, res.outputs))


if __name__ == "__main__":
    main()
