"""How conversion grows with the model and the input size: torchvision classifiers at several
input sides, on made images (the cost does not depend on what the images show).

Per cell (model, side), in a fresh process of its own so that its peak memory is its own:
the seconds and the peak resident memory of each stage of ``convert(..., finetune_epochs=0)``
with ``--steps`` reconstruction steps (prepare, fold, QCFS thresholds, the bias, membrane and
weight calibration at 2T, the reconstruction, timed over its steps and extrapolated to the
default 300), one ANN training step (what a QCFS training step costs, about), one BPTT step at
T (``snnconv.finetune``, one step of a batch, per image) and the SNN's inference at T against
T ANN forwards. The memory is sampled every 20 ms (``/proc/self/statm``) and each stage gets
the highest sample within its time; the allocator is trimmed between stages.

    nice -n 10 .venv/bin/python -m benchmarks scale sides            # every cell not yet in the JSON
    .venv/bin/python -m benchmarks scale sides --models resnet18 --sizes 32 64 --fresh

Results: ``results/scale.json`` (one entry per cell, written as each finishes) and
``results/scale.md`` (the tables of benchmarks/README.md, "Scale").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

from ..common import RESULTS, child_env, module_command

MODELS = ("resnet18", "resnet50", "vgg16_bn", "mobilenet_v2")
SIZES = (32, 64, 128, 224)
STAGES = ("prepare", "fold", "qcfs", "calibration", "reconstruction")


class Sampler(threading.Thread):
    """The process's resident memory every ``every`` seconds: ``(time, bytes)`` samples."""

    def __init__(self, every: float = 0.02):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.every)

    def peak(self, start: float, end: float) -> float:
        """The highest sample in ``[start, end]`` in GiB (the one just before, for a short window)."""
        inside = [r for t, r in self.samples if start <= t <= end]
        if not inside:
            inside = [r for t, r in self.samples if t <= end][-1:] or [self.rss()]
        return round(max(inside) / 2**30, 3)


def _trim() -> None:
    """Give freed heap memory back to the system, so that the next stage's peak is its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def cell(name: str, size: int, *, T: int, images: int, batch: int, steps: int, threads: int) -> dict:
    """One model at one input side: every stage's seconds and peak memory."""
    import torch

    torch.set_num_threads(threads)
    import snnconv
    from snnconv.models.tv import TVModel, build

    sampler = Sampler()
    sampler.start()
    out: dict = {"model": name, "size": size, "T": T, "images": images, "batch": batch,
                 "threads": threads, "torch": torch.__version__}
    model = build(TVModel(name, size=size))
    out["parameters"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(images, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (images,), generator=gen)
    loader = [(x[i:i + batch], y[i:i + batch]) for i in range(0, images, batch)]
    _trim()
    out["rss_start_gib"] = sampler.peak(time.perf_counter() - 0.1, time.perf_counter())

    # the calibration path and a few reconstruction steps: stage windows from meta's seconds
    t0 = time.perf_counter()
    snn, meta = snnconv.convert(model, loader, T=T, finetune_epochs=0, qcfs_epochs=0,
                                reconstruction_steps=steps, progress=False, on_collapse="warn")
    t_end = time.perf_counter()
    stages, t = {}, t0
    for rec in meta.stages:
        stages[rec.name] = (t, t + rec.seconds)
        t += rec.seconds
    rec = meta.stage("spiking").changes
    recon = rec.get("reconstruction", {})
    s0, s1 = stages.pop("spiking")
    stages["calibration"] = (s0, s1 - recon.get("seconds", 0.0))
    stages["reconstruction"] = (s1 - recon.get("seconds", 0.0), s1)
    out["stages"] = {k: {"seconds": round(b - a, 2), "peak_gib": sampler.peak(a, b)}
                     for k, (a, b) in stages.items()}
    out["convert_seconds"] = round(t_end - t0, 2)
    out["convert_peak_gib"] = sampler.peak(t0, t_end)
    out["calibration"] = {k: rec.get("bias_calibration", {}).get(k) for k in ("method", "groups", "T")}
    if recon:
        per_step = recon["seconds"] / recon["steps"]
        out["reconstruction"] = {"steps_timed": recon["steps"], "seconds_per_step": round(per_step, 2),
                                 "micro_batch": recon.get("micro_batch"),
                                 "default_300_steps_hours": round(300 * per_step / 3600, 2)}
    _trim()

    # one ANN training step (QCFS training's step is this network with QCFS in place of ReLU)
    ann = build(TVModel(name, size=size)).train()
    xb, yb = loader[0]
    opt = torch.optim.SGD(ann.parameters(), lr=1e-3)

    def ann_step(ann=ann, opt=opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ann(xb), yb).backward()
        opt.step()

    a = time.perf_counter()
    sec = _timed(ann_step, repeat=2)
    out["ann_step"] = {"seconds_per_image": round(sec / len(xb), 4), "peak_gib": sampler.peak(a, time.perf_counter())}
    del ann, opt
    _trim()

    # one BPTT step at T (a batch, in the micro-batches that fit), per image
    a = time.perf_counter()
    tuned, history = snnconv.finetune(snn, [loader[0]], T=T, epochs=1, val_fraction=0.0,
                                      progress=False)
    b = time.perf_counter()
    out["bptt"] = {"T": T, "batch": len(xb), "seconds_per_image": round(history[0]["seconds"] / len(xb), 3),
                   "peak_gib": sampler.peak(a, b), **tuned.meta.get("finetune_step", {})}
    del tuned
    _trim()

    # inference: the SNN at T against T forwards of the ANN, on one batch
    model.eval()
    with torch.no_grad():
        a = time.perf_counter()
        snn_s = _timed(lambda: snn(xb), repeat=2)
        ann_s = _timed(lambda: [model(xb) for _ in range(T)], repeat=2)
        b = time.perf_counter()
    out["inference"] = {"snn_seconds": round(snn_s, 3), "ann_T_seconds": round(ann_s, 3),
                        "ratio": round(snn_s / ann_s, 2), "peak_gib": sampler.peak(a, b)}
    sampler.stop.set()
    out["peak_gib"] = sampler.peak(0.0, time.perf_counter())
    return out


def _row_value(r: dict, key: str) -> str:
    v = r
    for k in key.split("."):
        v = v.get(k, {}) if isinstance(v, dict) else {}
    return "" if v in ({}, None) else str(v)


def markdown(rows: list[dict], machine: str) -> str:
    """The stage table and the growth table."""
    rows = sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99, r["size"]))
    lines = [f"{machine}. Seconds / peak resident GiB of the whole process (model, data and the "
             "stage); reconstruction per step, extrapolated to 300; BPTT and ANN training per image.", "",
             "| model | side | prepare | fold | QCFS thresholds | calibration (2T) | reconstruction step "
             "(300 steps) | ANN train step / image | BPTT T=4 / image (micro-batch) | SNN T=4 vs 4 ANN | peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | {r['error'][:120]} |" + " |" * 9)
            continue
        st = r["stages"]

        def stage(k, st=st):
            return f"{st[k]['seconds']:.1f} s / {st[k]['peak_gib']:.1f}" if k in st else ""
        rc = r.get("reconstruction", {})
        lines.append(
            f"| {r['model']} | {r['size']} | {stage('prepare')} | {stage('fold')} | {stage('qcfs')} | "
            f"{stage('calibration')} | {rc.get('seconds_per_step', '')} s "
            f"({rc.get('default_300_steps_hours', '')} h) / {st['reconstruction']['peak_gib']:.1f} | "
            f"{r['ann_step']['seconds_per_image']} s / {r['ann_step']['peak_gib']:.1f} | "
            f"{r['bptt']['seconds_per_image']} s ({r['bptt'].get('micro_batch', '')}) / {r['bptt']['peak_gib']:.1f} | "
            f"{r['inference']['ratio']}x | {r['peak_gib']:.1f} |")
    lines += ["", "Growth from the smallest to the largest side measured (pixels x"
              " (largest/smallest)^2): seconds of the calibration, a reconstruction step, a BPTT image,"
              " and the peak.", "",
              "| model | sides | pixels | calibration | reconstruction step | BPTT / image | peak |",
              "|---|---|---|---|---|---|---|"]
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            by_model.setdefault(r["model"], []).append(r)
    for m, rs in by_model.items():
        if len(rs) < 2:
            continue
        lo, hi = rs[0], rs[-1]

        def ratio(f, lo=lo, hi=hi):
            try:
                return f"{f(hi) / f(lo):.1f}x"
            except (KeyError, ZeroDivisionError, TypeError):
                return ""
        lines.append(f"| {m} | {lo['size']} -> {hi['size']} | {(hi['size'] / lo['size']) ** 2:.0f}x | "
                     f"{ratio(lambda r: r['stages']['calibration']['seconds'])} | "
                     f"{ratio(lambda r: r['reconstruction']['seconds_per_step'])} | "
                     f"{ratio(lambda r: r['bptt']['seconds_per_image'])} | {ratio(lambda r: r['peak_gib'])} |")
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _machine() -> str:
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core {name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--images", type=int, default=64, help="made images (the calibration draws min(4, batches) batches)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=2, help="reconstruction steps timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per cell")
    p.add_argument("--out", default=os.path.join(RESULTS, "scale.json"))
    p.add_argument("--fresh", action="store_true", help="measure the cells again")
    p.add_argument("--cell", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = dict(T=args.T, images=args.images, batch=args.batch, steps=args.steps, threads=args.threads)
    if args.cell:
        print("RESULT " + json.dumps(cell(args.cell[0], int(args.cell[1]), **settings)), flush=True)
        return 0
    done = {}
    if os.path.exists(args.out) and not args.fresh:
        with open(args.out) as f:
            done = {f"{r['model']}@{r['size']}": r for r in json.load(f)["cells"]}
    machine = _machine()
    for size in args.sizes:  # every model at a side before the next side: the small cells come first
        for name in args.models:
            key = f"{name}@{size}"
            if key in done and "error" not in done[key]:
                continue
            cmd = module_command("benchmarks.scale.sides", "--cell", name, str(size),
                                 *[f"--{k}={v}" for k, v in settings.items()])
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=child_env())
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                row = json.loads(line[-1][7:]) if line else {
                    "model": name, "size": size, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            except subprocess.TimeoutExpired:
                row = {"model": name, "size": size, "error": f"over {args.timeout:.0f} s"}
            row["wall_seconds"] = round(time.perf_counter() - start, 1)
            done[key] = row
            cells = sorted(done.values(), key=lambda r: (r["size"], r["model"]))
            _write(args.out, json.dumps({"machine": machine, "settings": settings, "cells": cells}, indent=1) + "\n")
            _write(os.path.splitext(args.out)[0] + ".md",
                   markdown(cells, f"{machine}, {args.threads} torch thread(s)"))
            print(f"{key}: {row.get('error') or str(row['wall_seconds']) + ' s'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
