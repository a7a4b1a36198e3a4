"""ResNet-50 at ImageNet size on this machine: what ``convert()`` costs in memory, and how soon
it says what it will do.

torchvision's ``resnet50`` (random weights, BatchNorm statistics from the images: the cost does
not depend on what was learnt) at 3x224x224, a labelled loader of ``--images`` made images in
batches of 16, ``T=4``. Each run is its own process; this one watches it: its peak resident
memory (the kernel's ``VmHWM``), and its log lines with their times.

- ``training-free``: ``convert(model, loader, T=4, finetune_epochs=0, reconstruction_steps=2)``
  to the end: seconds and peak memory.
- ``default``: ``convert(model, loader, T=4)`` as a user calls it: the seconds until its plan is
  logged, the plan, and the peak memory through the calibration and the first ``--steps``
  steps of its first training stage, then stopped (the whole run would take hours here; the
  plan says how many).

    .venv/bin/python -m benchmarks scale resnet50_224              # both
    .venv/bin/python -m benchmarks scale resnet50_224 --runs default

Results: ``results/resnet50_224.json`` (one entry per run, written as each finishes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

from snnconv.io.atomic import atomic_write_text

from ..common import RESULTS, child_env

RUNS = {
    "training-free": {"finetune_epochs": 0, "reconstruction_steps": 2},
    "default": {},
}

CHILD = r"""
import json, sys, torch, torchvision
from torch.utils.data import DataLoader, TensorDataset
import snnconv
args = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(args["threads"])
x = torch.rand(args["images"], 3, args["side"], args["side"])
y = torch.randint(0, 1000, (args["images"],))
model = torchvision.models.resnet50()
model.train()
with torch.no_grad():  # BatchNorm statistics of these images, as a trained network has its data's
    for i in range(0, len(x), 16):
        model(x[i:i + 16])
model.eval()
print("READY", flush=True, file=sys.stderr)
snn, meta = snnconv.convert(model, DataLoader(TensorDataset(x, y), batch_size=16), T=4, **args["settings"])
print("DONE", json.dumps(meta.settings.get("budget", {})), flush=True, file=sys.stderr)
"""

PROGRESS = re.compile(r"^(QCFS epoch \d+/\d+|reconstruction|BPTT epoch \d+/\d+): (\d+)/")


def _hwm(pid: int) -> float | None:
    """The process's peak resident memory so far, GiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kb / 2**20
    except (OSError, StopIteration):
        return None


def watch(name: str, settings: dict, args) -> dict:
    """Run ``convert`` with ``settings`` in a child; stop it per the run's rule."""
    payload = json.dumps({"threads": args.threads, "images": args.images, "side": args.side, "settings": settings})
    env = child_env()
    child = subprocess.Popen([sys.executable, "-c", CHILD, payload], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True, env=env)
    start = time.perf_counter()
    row: dict = {"run": name, "settings": settings, "lines": []}
    stages: dict[str, dict] = {}
    peak = [0.0]

    def sample() -> None:
        while child.poll() is None:
            peak[0] = max(peak[0], _hwm(child.pid) or 0.0)
            time.sleep(0.2)
    threading.Thread(target=sample, daemon=True).start()
    plan: list[str] = []
    for line in child.stderr:
        now = round(time.perf_counter() - start, 1)
        line = line.rstrip("\n")
        print(f"[{name} {now:7.1f} s] {line}", flush=True)
        row["lines"].append([now, line[:300]])
        if line == "READY":
            row["model_ready_seconds"] = now
        if line.startswith("snnconv plan on") or (plan and line.startswith("  ")):
            plan.append(line)
            row.setdefault("plan_seconds", now)
            row["plan"] = plan
        m = PROGRESS.match(line)
        if m:
            stage = m.group(1).split(" ")[0]
            stages.setdefault(stage, {"first_seconds": now})
            stages[stage].update(steps=int(m.group(2)), seconds=now,
                                 peak_gib=round(max(peak[0], _hwm(child.pid) or 0), 2))
        if line.startswith("DONE"):
            row["budget"] = json.loads(line.split(" ", 1)[1])
        stop = name == "default" and any(s["steps"] >= args.steps for s in stages.values())
        if stop or now > args.limit:
            row["stopped"] = "after the first steps" if stop else f"at the {args.limit:.0f} s limit"
            peak[0] = max(peak[0], _hwm(child.pid) or 0.0)
            child.kill()
            break
    child.wait()
    row.update(seconds=round(time.perf_counter() - start, 1), peak_gib=round(peak[0], 2), stages=stages,
               exit=child.returncode)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--steps", type=int, default=2, help="steps of a training stage watched before stopping")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=float, default=3600.0, help="seconds a run may take before it is stopped")
    p.add_argument("--out", default=os.path.join(RESULTS, "resnet50_224.json"))
    args = p.parse_args(argv)
    rows = json.load(open(args.out))["runs"] if os.path.exists(args.out) else []
    for name in args.runs:
        rows = [r for r in rows if r["run"] != name]
        rows.append(watch(name, RUNS[name], args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "lines"}, indent=1), flush=True)
        atomic_write_text(args.out, json.dumps({"model": "resnet50", "input": [3, args.side, args.side],
                                                "images": args.images, "batch": 16, "T": 4,
                                                "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
