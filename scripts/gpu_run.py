"""One command for a CUDA machine: the CUDA tests, ``python -m benchmarks gpu_check`` and a default
conversion with fine-tuning, every result as JSON under one folder.

    python scripts/gpu_run.py --out gpu-run                          # on a CUDA machine, < 8 minutes
    python scripts/gpu_run.py --device cpu --small --out /tmp/g-run  # the same steps, small, on CPU

On a machine with its own torch and no registry it runs from the bundle that
``scripts/gpu_bundle.sh`` builds: ``bash gpu-bundle/run.sh OUT`` (docs/gpu.md). Each step runs
in its own process with its share of ``--budget`` seconds, and writes into ``--out``:

- ``environment.json``: Python, torch, CUDA and the GPU, the version of every package snnconv
  requires and whether its range is met;
- ``tests.json`` (``tests.log``): ``pytest -m cuda``, the tests that need a GPU (on CPU they are
  collected and skipped), each test's outcome and seconds;
- ``gpu_check.json`` (``gpu_check.log``): ``python -m benchmarks gpu_check`` (``--small`` on CPU);
- ``convert.json`` (``convert.log``): ``snnconv.convert(model, loader, device=...)`` with its
  defaults (T=8, calibration, BPTT fine-tuning) on the zoo's CIFAR ResNet-18 and made data
  (random images with random labels: the cost, not the accuracy, is the point): each stage's
  seconds, the whole wall time and the peak memory. ``--small``: ResNet-8, 32 images, T=2,
  one epoch of fine-tuning (and gpu_check without its compiled neuron);
- ``summary.json``: each step's exit code, seconds and closing line.

Exit status: 0 when every step passed, 1 when one failed or ran out of time, 2 for a usage
error (``--device cuda`` where no GPU is visible, say).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# an installed snnconv (the bundle's wheel) first, else this checkout's
sys.path += [ROOT, os.path.join(ROOT, "backends")]
#: each step's share of --budget (the rest of the 8 minutes is the bundle's install)
SHARES = {"tests": 0.35, "gpu_check": 0.3, "convert": 0.35}


def _write(path: str, data) -> None:
    from snnconv.io.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def environment() -> dict:
    """Python, torch, CUDA, the GPU, and each requirement of snnconv: installed version, met."""
    from importlib import metadata

    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        from packaging.requirements import Requirement

        requires = [Requirement(r) for r in metadata.requires("snnconv") or []]
        env["snnconv"] = metadata.version("snnconv")
    except metadata.PackageNotFoundError:
        env["snnconv"], requires = None, []  # run from a checkout that is not installed
    reqs = {}
    for req in requires:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's (the tests')
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            version = None
        reqs[req.name] = {"wants": str(req.specifier), "installed": version,
                          "met": version is not None and req.specifier.contains(version, prereleases=True)}
    env["requirements"] = reqs
    env["requirements_met"] = all(r["met"] for r in reqs.values())
    return env


def _closing_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_step(name: str, argv: list[str], out: str, timeout: float) -> dict:
    """Run one step in its own process, its output in ``<out>/<name>.log``."""
    start = time.perf_counter()
    log = os.path.join(out, f"{name}.log")
    try:
        path = os.pathsep.join([ROOT, os.path.join(ROOT, "backends")] + [os.environ.get("PYTHONPATH", "")])
        proc = subprocess.run(argv, cwd=out, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)})
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        text = "".join(s.decode() if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr))
        text += f"\n{name}: stopped after its {timeout:.0f} s share of --budget\n"
    with open(log, "w") as fh:
        fh.write(text)
    record = {"exit": code, "seconds": round(time.perf_counter() - start, 1), "timeout_s": round(timeout),
              "closing_line": _closing_line(text), "log": os.path.basename(log)}
    print(f"[{'ok' if code == 0 else 'FAILED'}] {name} ({record['seconds']} s): {record['closing_line']}",
          flush=True)
    return record


def junit_summary(path: str) -> dict:
    """Counts and each test's outcome and seconds from pytest's JUnit XML."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0)})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": cases}


def convert_step(device: str, small: bool, path: str) -> None:
    """The default conversion of the zoo's CIFAR ResNet-18 on made data, on ``device``."""
    import resource

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import snnconv
    from snnconv import models

    name, n, batch, T = ("resnet8", 32, 16, 2) if small else ("resnet18", 4096, 64, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 32, 32, generator=gen) * 2 - 1
    y = torch.randint(0, 10, (n,), generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = models.get(name, num_classes=10, in_channels=3)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    # the default's 512 fine-tuning and 300 reconstruction steps are for real runs
    budget = {"finetune_epochs": 1, "reconstruction_steps": 2} if small else {}
    snn, meta = snnconv.convert(model, loader, T=T, device=device, progress=False, **budget)
    seconds = time.perf_counter() - start
    record = {"model": name, "images": n, "batch": batch, "T": T, "device": device,
              "seconds": round(seconds, 1),
              "stages": {s.name: round(s.seconds, 2) for s in meta.stages},
              "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
              "meta": meta.to_dict()}
    if device.startswith("cuda"):
        record["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        record["gpu"] = torch.cuda.get_device_name(device)
    _write(path, record)
    print(f"convert: {name} on {device}, {n} made images, T={T}: {seconds:.1f} s; stages "
          + ", ".join(f"{k} {v:.1f} s" for k, v in record["stages"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-run", help="the folder every result goes to (default gpu-run)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu")
    p.add_argument("--small", action="store_true", help="small networks and data: a check of the steps")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds for the three steps together (default 420)")
    p.add_argument("--skip", nargs="*", default=[], choices=sorted(SHARES), help="steps to leave out")
    p.add_argument("--step", choices=["convert"], help=argparse.SUPPRESS)  # the convert step's process
    args = p.parse_args(argv)

    from snnconv.cli.common import UsageError, check_device

    try:
        check_device(args.device)
    except UsageError as exc:
        print(f"gpu_run: error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    if args.step == "convert":
        convert_step(args.device, args.small, os.path.join(out, "convert.json"))
        return 0

    start = time.perf_counter()
    _write(os.path.join(out, "environment.json"), environment())
    small = ["--small", "--no-compiled"] if args.small else []
    check_budget = f"{SHARES['gpu_check'] * args.budget * 0.8:.0f}"  # its own sections stop in time
    steps = {
        "tests": [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests"), "-m", "cuda", "-q",
                  "-p", "no:cacheprovider", f"--junitxml={os.path.join(out, 'tests.xml')}"],
        "gpu_check": [sys.executable, "-m", "benchmarks", "gpu_check", "--device", args.device, *small,
                      "--budget", check_budget, "--out", os.path.join(out, "gpu_check.json")],
        "convert": [sys.executable, os.path.abspath(__file__), "--step", "convert", "--device", args.device,
                    *small[:1], "--out", out],
    }
    summary = {"command": " ".join(["scripts/gpu_run.py"] + (sys.argv[1:] if argv is None else argv)),
               "steps": {}}
    for name, cmd in steps.items():
        if name in args.skip:
            continue
        record = run_step(name, cmd, out, SHARES[name] * args.budget)
        junit = os.path.join(out, "tests.xml")
        if name == "tests" and os.path.exists(junit):
            _write(os.path.join(out, "tests.json"), {**record, **junit_summary(junit)})
        summary["steps"][name] = record
    summary["seconds"] = round(time.perf_counter() - start, 1)
    summary["passed"] = all(r["exit"] == 0 for r in summary["steps"].values())
    _write(os.path.join(out, "summary.json"), summary)
    print(f"gpu_run: {'every step passed' if summary['passed'] else 'a step failed'} in "
          f"{summary['seconds']:.0f} s; results in {out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
