"""Several fine-tuning benchmark runs side by side, one process each, tabulated.

    .venv/bin/python -m benchmarks matrix sweep --set knobs --device cuda --jobs 16 \
        --out benchmarks/results/sweep_knobs_gpu

Each run is ``benchmarks/matrix/finetune.py`` at T=4 for 2 epochs with a base recipe (AdamW lr
1e-3, trained thresholds, distillation 0.5, horizons (2, 4), batch 64) plus its own flags:
``knobs`` changes one setting at a time, ``combo`` combines the best ones over seeds. Every run writes its
own JSON and log under ``<out>_runs/``; ``<out>.json`` gathers accuracy by T on the full test
set, the validation accuracy of the best epoch and the wall time, and is rewritten as runs end
(an interrupted sweep keeps what finished). On a GPU the runs share the device; on CPU give
each ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from ..common import RESULTS, child_env, module_command, write_json

BASE = ["--epochs", "2", "--lr", "1e-3", "--train-thresholds", "--distill", "0.5", "--batch-size", "64",
        "--finetune-T", "4", "--skip-memory", "--quiet"]
SETS = {}
SETS["knobs"] = {
    "lr5e-4": ["--lr", "5e-4"], "lr2e-3": ["--lr", "2e-3"],
    "batch32": ["--batch-size", "32"], "batch128": ["--batch-size", "128"],
    "distill0": ["--distill", "0"], "distill1": ["--distill", "1"],
    "frozen-thresholds": ["--no-train-thresholds"],
    "alpha1": ["--alpha", "1"], "alpha4": ["--alpha", "4"], "detach-reset": ["--detach-reset"],
    "horizon4": ["--horizons"], "horizons1-2-4": ["--horizons", "1", "2"],
    "smoothing0.1": ["--label-smoothing", "0.1"], "wd0.01": ["--weight-decay", "0.01"],
    "F": ["--convert-T", "4"], "F-L4": ["--convert-T", "4", "--convert-L", "4"],
}
A4, LR2, H4 = ["--alpha", "4"], ["--lr", "2e-3"], ["--horizons"]
SETS["combo"] = {
    **{f"a4-lr2e-3-s{s}": A4 + LR2 + ["--seed", str(s)] for s in (0, 1, 2)},
    **{f"a4-lr2e-3-h4-s{s}": A4 + LR2 + H4 + ["--seed", str(s)] for s in (0, 1, 2)},
    **{f"a4-s{s}": A4 + ["--seed", str(s)] for s in (1, 2)},
    **{f"lr2e-3-s{s}": LR2 + ["--seed", str(s)] for s in (1, 2)},
    **{f"a4-h4-s{s}": A4 + H4 + ["--seed", str(s)] for s in (0, 1)},
    "a4-lr2e-3-detach-s0": A4 + LR2 + ["--detach-reset"],
    "a8-s0": ["--alpha", "8"],
    "a4-lr3e-3-s0": A4 + ["--lr", "3e-3"],
    "a4-lr2e-3-batch32-s0": A4 + LR2 + ["--batch-size", "32"],
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--set", default="knobs", choices=list(SETS), help="which runs")
    p.add_argument("--runs", nargs="*", default=None, help="only these runs of the set")
    p.add_argument("--amp", action="store_true",
                   help="on CUDA: bfloat16 autocast (default: float32 without TF32, as on CPU)")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which a run is stopped")
    p.add_argument("--extra", default="", help="more flags for every run (e.g. '--max-steps 5')")
    p.add_argument("--out", default=os.path.join(RESULTS, "sweep"))
    args = p.parse_args(argv)
    flags = SETS[args.set]
    unknown = set(args.runs or ()) - set(flags)
    if unknown:
        p.error(f"runs {sorted(unknown)} are not in set {args.set!r}: {sorted(flags)}")
    args.runs = args.runs or list(flags)
    folder = args.out + "_runs"
    os.makedirs(folder, exist_ok=True)
    common = BASE + ["--device", args.device, "--threads", str(args.threads), *shlex.split(args.extra)]
    if args.device.startswith("cuda") and not args.amp:
        common.append("--no-amp")
    summary = {"settings": {"base": BASE, "set": args.set, "device": args.device, "amp": args.amp},
               "runs": {}}

    def run(name: str) -> None:
        out = os.path.join(folder, f"{os.path.basename(args.out)}.{name}")  # also names its checkpoint
        cmd = module_command("benchmarks.matrix.finetune", *common, *flags[name], "--out", out)
        t0 = time.perf_counter()
        with open(out + ".log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    env=child_env()).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        record = {"flags": flags[name], "returncode": rc, "seconds": time.perf_counter() - t0}
        if rc == 0:
            with open(out + ".json") as fh:
                result = json.load(fh)
            tuned = next(v for k, v in result["accuracy"].items() if k.startswith("fine-tuned"))
            record.update(test=tuned, val=max(h["val_acc"] for h in result["history_T4"]),
                          finetune_s=result["timing"]["finetune_T4_s"])
        summary["runs"][name] = record
        write_json(summary, args.out + ".json")
        print(name, rc, record.get("test"), f"val {record.get('val')}", f"{record['seconds']:.0f} s",
              flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(run, args.runs))


if __name__ == "__main__":
    main()
