"""Memory and time of the weight fit on a wide Linear: VGG's classifier at 224 px (25,088 inputs,
4,096 outputs) fitted on 4 calibration batches of 128 images (512 positions, one per image),
against a layer of as many inputs as positions fit in the features' normal equations.

    .venv/bin/python -m benchmarks.studies.weight_fit --out benchmarks/results/weight_fit.json

Fewer positions than features: the fit solves in the positions' Gram matrix (positions^2
values); else in the features' (features^2). Peak memory is the process's peak resident size
(``ru_maxrss``) above what it held before the fit, each case in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from ..common import STUDIES_RESULTS, child_env, module_command


def one(features: int, outputs: int, positions: int, steps: int) -> dict:
    import torch

    from snnconv.calibration.weights import RIDGE, WeightFit, layer_output

    torch.manual_seed(0)
    layer, ref = torch.nn.Linear(features, outputs), torch.nn.Linear(features, outputs)
    rates = torch.randint(0, steps + 1, (positions, features)).float().div_(steps)
    with torch.no_grad():
        y = layer_output(ref, rates)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fit = WeightFit(layer, ref, steps=steps, positions=positions)
    fit.add(rates, y, torch.arange(positions))
    change = fit.solve(RIDGE)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"features": features, "outputs": outputs, "positions": positions, "dual": fit.dual,
            "seconds": seconds, "peak_mib": peak / 1024, "weight_change": change,
            "features_gram_gib": 2 * features**2 * 8 / 2**30}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(STUDIES_RESULTS, "weight_fit.json"))
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(one(*json.loads(args.case))))
        return 0
    cases = [(25088, 4096, 512, 16), (4096, 4096, 512, 16), (4096, 4096, 8192, 16)]
    rows = []
    for case in cases:
        out = subprocess.run(module_command("benchmarks.studies.weight_fit", "--case", json.dumps(case)),
                             check=True, capture_output=True, text=True, env=child_env()).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['features']:>6} inputs, {r['positions']:>5} positions: {'positions' if r['dual'] else 'features'}' "
              f"Gram, {r['seconds']:.1f} s, peak +{r['peak_mib']:.0f} MiB (features' Gram and its "
              f"factor: {r['features_gram_gib']:.2f} GiB)", flush=True)
    from snnconv.io.atomic import atomic_write_text

    atomic_write_text(args.out, json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
