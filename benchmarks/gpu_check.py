"""GPU backend check: correctness against the cpu backend, and throughput against the ANN.

On the CIFAR ResNet-18 (3x32x32, random BatchNorm statistics, converted on random data: speed
and agreement do not depend on what the weights learned), in one command:

1. correctness (a small batch, T=4): gpu float32 deterministic vs the cpu backend (outputs,
   spike counts per layer, threshold ties), gpu fused (compiled) vs gpu loop, torch
   SpikingNetwork on the GPU vs the gpu backend, bfloat16 vs float32 agreement;
2. throughput at batch 256, T = 4 and 8, in image-steps per second: the folded ANN (T forwards;
   float32 and bfloat16 autocast), the torch SpikingNetwork, the gpu backend (float32 fast mode,
   float32 deterministic, bfloat16; the neuron loop, then the compiled fused neuron).

Every section is guarded: an error is recorded in the JSON and the run goes on; sections that
would overrun ``--budget`` seconds are skipped (and say so). Exit status 0 unless the set-up
itself fails.

    python -m benchmarks gpu_check                        # on a CUDA machine (< 4 minutes)
    python -m benchmarks gpu_check --tiny --out DIR       # the code paths on CPU, about 20 s
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback

import torch

import snnconv
from snnconv import models
from snnconv.io.atomic import atomic_write_text
from snnconv.snn.nir_io import export_nir
from snnconv.stages.fold import fold_batchnorm
from snnconv_backends.gpu import GPUBackend

from .common import RESULTS, randomise_bn


class Check:
    """Runs guarded sections against a time budget and collects their records."""

    def __init__(self, budget: float):
        self.start = time.perf_counter()
        self.budget = budget
        self.report: dict = {"sections": {}, "errors": {}, "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn, need: float = 0.0):
        if self.elapsed() + need > self.budget:
            self.report["skipped"].append(
                f"{name} (budget: {self.elapsed():.0f} s used of {self.budget:.0f})")
            print(f"[skip] {name}: over budget", flush=True)
            return None
        t0 = time.perf_counter()
        try:
            out = fn()
            self.report["sections"][name] = out
            print(f"[ok]   {name} ({time.perf_counter() - t0:.1f} s): {json.dumps(out)[:300]}", flush=True)
            return out
        except Exception as exc:  # keep going: one broken path must not hide the others
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"[FAIL] {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)
            return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def compare(a, b) -> dict:
    """Agreement of two RunResults: output difference, spike-count differences per layer."""
    diff = (a.outputs.float().cpu() - b.outputs.float().cpu()).abs()
    layers = {}
    for name in a.spikes:
        layers[name] = float((a.spikes[name] - b.spikes[name]).abs().sum())
    total = sum(float(s.sum()) for s in a.spikes.values())
    return {"max_abs_output_diff": float(diff.max()), "outputs_identical": bool(diff.max() == 0),
            "prediction_agreement": float((a.outputs.float().mean(0).argmax(-1).cpu()
                                           == b.outputs.float().mean(0).argmax(-1).cpu()).float().mean()),
            "spike_count_abs_diff_total": sum(layers.values()), "spikes_total": total,
            "layers_with_differences": sum(1 for v in layers.values() if v)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="ResNet-8, batch 8, T=2: a smoke test")
    p.add_argument("--tiny", action="store_true",
                   help="--device cpu --small --no-compiled, the JSON written into the folder --out "
                        "(default: a temporary one)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--T", nargs="+", type=int, default=[4, 8])
    p.add_argument("--check-batch", type=int, default=16, help="batch of the cpu comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=220.0, help="seconds; later sections are skipped")
    p.add_argument("--no-compiled", action="store_true", help="skip the torch.compile neuron")
    p.add_argument("--out", default=None, help=f"the JSON (default {os.path.join(RESULTS, 'gpu_check.json')})")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.small, args.no_compiled = "cpu", True, True
        args.out = os.path.join(args.out or tempfile.mkdtemp(prefix="benchmarks-gpu_check-"), "gpu_check.json")
    args.out = args.out or os.path.join(RESULTS, "gpu_check.json")
    model_name, batch, Ts, check_batch = "resnet18", args.batch, args.T, args.check_batch
    if args.small:
        model_name, batch, Ts, check_batch = "resnet8", min(args.batch, 8), [2], min(check_batch, 4)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu --small for a smoke test", file=sys.stderr)
        return 2
    check = Check(args.budget)
    rep = check.report
    rep.update({"model": model_name, "batch": batch, "T": Ts, "device": str(device),
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "command": " ".join(["python -m benchmarks gpu_check"]
                                    + (sys.argv[1:] if argv is None else argv))})

    # --- set-up: the network, converted on random data ---
    torch.manual_seed(0)
    model = randomise_bn(models.get(model_name, num_classes=10, in_channels=3))
    gen = torch.Generator().manual_seed(0)
    calib = torch.rand(64, 3, 32, 32, generator=gen) * 2 - 1
    T0 = Ts[0]
    snn, _ = snnconv.convert(copy.deepcopy(model), [(calib, torch.zeros(64, dtype=torch.long))], T=T0,
                             calib_batches=1, bias_calibration=False, progress=False)
    ann = fold_batchnorm(model, calib[:2]).eval()
    graph = export_nir(snn, input_shape=(3, 32, 32))
    gpu = GPUBackend()
    x_check = torch.rand(check_batch, 3, 32, 32, generator=gen) * 2 - 1
    x = torch.rand(batch, 3, 32, 32, generator=gen) * 2 - 1
    rep["setup_seconds"] = check.elapsed()
    print(f"set-up {check.elapsed():.1f} s: {model_name}, batch {batch}, T {Ts}, device {device}", flush=True)

    # --- 1. correctness ---
    cpu_ref = {}

    def cpu_reference():
        r = snnconv.backends.get("cpu").compile(graph).run(x_check, T0)
        cpu_ref["r"] = r
        return {"seconds": r.extra["seconds"], "spike_rate_check": None}

    check.section("cpu_reference", cpu_reference)

    def gpu_vs_cpu():
        prog = gpu.compile(graph, device=str(device), count_ties=True)
        r = prog.run(x_check, T0)
        out = compare(r, cpu_ref["r"])
        out["threshold_ties"] = r.extra["threshold_ties"]
        out["tie_tolerance"] = r.extra["tie_tolerance"]
        again = prog.run(x_check, T0)
        out["repeatable"] = bool(torch.equal(again.outputs, r.outputs))
        return out

    if "r" in cpu_ref or check.section("cpu_reference_retry", cpu_reference):
        check.section("gpu_float32_deterministic_vs_cpu", gpu_vs_cpu)

    def torch_snn_vs_gpu():
        net = copy.deepcopy(snn).to(device)
        net.chunk_size = 0
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.no_grad():
            ref = net.run(x_check.to(device), T0).cpu()
        r = gpu.compile(graph, device=str(device), neuron="loop").run(x_check, T0)
        d = (r.outputs.cpu() - ref).abs().max()
        return {"max_abs_output_diff": float(d), "identical": bool(d == 0)}

    check.section("torch_snn_on_device_vs_gpu_backend", torch_snn_vs_gpu)

    def bf16_vs_fp32():
        a = gpu.compile(graph, device=str(device), dtype="bfloat16", neuron="loop").run(x_check, T0)
        b = gpu.compile(graph, device=str(device), neuron="loop").run(x_check, T0)
        return compare(a, b)

    check.section("gpu_bfloat16_vs_float32", bf16_vs_fp32)

    if not args.no_compiled:
        def compiled_vs_loop():
            t0 = time.perf_counter()
            a = gpu.compile(graph, device=str(device), neuron="compiled").run(x_check, T0)
            first = time.perf_counter() - t0
            b = gpu.compile(graph, device=str(device), neuron="loop").run(x_check, T0)
            out = compare(a, b)
            out["first_call_seconds"] = first
            return out

        check.section("gpu_compiled_vs_loop", compiled_vs_loop, need=30)

    # --- 2. throughput ---
    xd = x.to(device)
    rows = rep.setdefault("throughput", [])

    def row(name, T, seconds):
        r = {"method": name, "T": T, "batch": batch, "seconds": seconds,
             "image_steps_per_s": batch * T / seconds}
        rows.append(r)
        return r

    ann_d = copy.deepcopy(ann).to(device)
    for T in Ts:
        def ann_fp32(T=T):
            torch.backends.cudnn.benchmark = True
            torch.backends.cudnn.deterministic = False
            with torch.no_grad():
                return row("ann_float32", T, best_time(lambda: [ann_d(xd) for _ in range(T)], device,
                                                       args.repeats))

        check.section(f"ann_float32_T{T}", ann_fp32, need=5)

        def ann_bf16(T=T):
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                return row("ann_bfloat16_autocast", T,
                           best_time(lambda: [ann_d(xd) for _ in range(T)], device, args.repeats))

        if device.type == "cuda":  # autocast timing means something on CUDA only
            check.section(f"ann_bfloat16_T{T}", ann_bf16, need=5)

        def torch_snn(T=T):
            net = copy.deepcopy(snn).to(device)
            net.chunk_size = 0
            with torch.no_grad():
                return row("torch_snn_float32", T, best_time(lambda: net.run(xd, T), device, args.repeats))

        check.section(f"torch_snn_T{T}", torch_snn, need=10)

        for label, opts in [("gpu_float32_fast_loop", {"deterministic": False, "neuron": "loop"}),
                            ("gpu_float32_deterministic_loop", {"neuron": "loop"}),
                            ("gpu_bfloat16_loop", {"dtype": "bfloat16", "neuron": "loop"})]:
            def backend_row(T=T, label=label, opts=opts):
                prog = gpu.compile(graph, device=str(device), **opts)
                return row(label, T, best_time(lambda: prog.run(xd, T), device, args.repeats))

            check.section(f"{label}_T{T}", backend_row, need=10)

    if not args.no_compiled:
        for T in Ts:
            for label, opts in [("gpu_float32_fast_compiled", {"deterministic": False, "neuron": "compiled"}),
                                ("gpu_bfloat16_compiled", {"dtype": "bfloat16", "neuron": "compiled"})]:
                def compiled_row(T=T, label=label, opts=opts):
                    prog = gpu.compile(graph, device=str(device), **opts)
                    return row(label, T, best_time(lambda: prog.run(xd, T), device, args.repeats))

                check.section(f"{label}_T{T}", compiled_row, need=40)

    # ratios to T ANN float32 forwards
    ann_s = {r["T"]: r["seconds"] for r in rows if r["method"] == "ann_float32"}
    for r in rows:
        if r["T"] in ann_s:
            r["ratio_to_T_ann_float32"] = r["seconds"] / ann_s[r["T"]]
    rep["total_seconds"] = check.elapsed()
    print("\n| method | T | batch | s | image-steps/s | x ANN fp32 |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['T']} | {r['batch']} | {r['seconds']:.4f} | "
              f"{r['image_steps_per_s']:.0f} | {r.get('ratio_to_T_ann_float32', float('nan')):.2f} |")
    print(f"\nerrors: {len(rep['errors'])}, skipped: {len(rep['skipped'])}, "
          f"total {rep['total_seconds']:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_text(args.out, json.dumps(rep, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
