"""Which torchvision classifiers convert, export to NIR and run on the cpu backend bit for bit.

Every model of :data:`snnconv.models.tv.RELU_FAMILY` and :data:`~snnconv.models.tv.NO_IF_FORM`
at each input size of ``--sizes`` (default 32 and 64 px; a model too small for a size is a row
that names the refusal), as a user brings it (``num_classes=10``, BatchNorm statistics from
three random batches), then
``convert(model, loader, T=4, finetune_epochs=0, reconstruction_steps=0)`` on two unlabelled
random batches (the calibration path: no training, no layer-wise reconstruction), ``export_nir`` and the cpu
backend on the exported graph against ``snn.run``
(outputs and per-layer spike counts, ``torch.equal``). Writes
``benchmarks/results/coverage.json`` and ``coverage.md``.

    python -m benchmarks coverage classifiers [--models resnet18,vgg11] [--small] [--sizes 32,64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

import torch

import snnconv
from snnconv.backends import get
from snnconv.constructs.prefix import analog_prefix
from snnconv.io.atomic import atomic_write_bytes
from snnconv.models.tv import NO_IF_FORM, RELU_FAMILY, TVModel, build

from ..common import RESULTS


def check(spec: TVModel, *, T: int = 4, **convert_kw) -> dict:
    """One row: converts / exports / cpu == torch SNN, or the refusal (its type and message)."""
    row = {"model": spec.name, "input": [3, spec.size, spec.size], "converts": False,
           "exports": False, "cpu_equal": False, "refusal": ""}
    start = time.perf_counter()
    try:
        try:
            model = build(spec)
        except (RuntimeError, ValueError) as exc:  # torchvision's own refusal of a small input
            raise snnconv.errors.DataError(f"the model rejects a {spec.size} px input: {exc}") from exc
        g = torch.Generator().manual_seed(1)
        loader = [torch.randn(4, 3, spec.size, spec.size, generator=g) for _ in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            snn, meta = snnconv.convert(model, loader, T=T, finetune_epochs=0, reconstruction_steps=0,
                                        progress=False, on_collapse="warn", **convert_kw)
        row["converts"] = True
        prefix = meta.stages[0].changes.get("constructs", {}).get("prefix", {})
        row["analog_prefix"] = prefix.get("ends_at", "")
        graph = snnconv.export_nir(snn)
        row["exports"] = True
        row["nir_nodes"] = len(graph.nodes)
        x = torch.randn(2, 3, spec.size, spec.size, generator=g)
        stem = analog_prefix(snn)
        with torch.no_grad():
            ref, counts = snn.run(x, T, spike_counts=True)
            result = get("cpu").compile(graph).run(stem(x) if stem is not None else x, T)
        row["cpu_equal"] = bool(torch.equal(result.outputs, ref) and set(result.spikes) == set(counts)
                                and all(torch.equal(result.spikes[k], c.double()) for k, c in counts.items()))
    except snnconv.errors.SnnconvError as exc:
        row["refusal"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | input | converts | exports | cpu == torch SNN | analog prefix ends at | refusal |",
             "|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for r in rows:
        lines.append(f"| {r['model']} | {'x'.join(map(str, r['input']))} | {yes[r['converts']]} | "
                     f"{yes[r['exports']]} | {yes[r['cpu_equal']]} | {r.get('analog_prefix', '')} | "
                     f"{r['refusal'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--small", action="store_true", help="only the models the test suite builds")
    ap.add_argument("--sizes", default="32,64", help="comma-separated input sides in px (default 32,64)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "coverage.json"),
                    help="results JSON (a .md beside it); rows it holds are kept, not run again")
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",") if v]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    specs = list(RELU_FAMILY) + [s for s, _ in NO_IF_FORM]
    if args.models:
        want = set(args.models.split(","))
        specs = [s for s in specs if s.name in want]
    if args.small:
        specs = [s for s in specs if not s.large]
    rows = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
    done = {(r["model"], tuple(r["input"])) for r in rows}
    for spec in specs:
        for size in sizes:
            if (spec.name, (3, size, size)) in done:
                continue
            rows.append(check(dataclasses.replace(spec, size=size)))
            print(json.dumps(rows[-1]), flush=True)
            _write(args.out, rows, argv)
    _write(args.out, rows, argv)
    print(markdown(rows))
    return 0


def _write(out: str, rows: list[dict], argv: list[str] | None) -> None:
    """The results so far (written after every row: a long run can stop and resume)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    payload = {"command": "python -m benchmarks coverage classifiers " + " ".join(argv or sys.argv[1:]),
               "torch": torch.__version__, "rows": rows}
    atomic_write_bytes(out, json.dumps(payload, indent=1).encode())
    atomic_write_bytes(os.path.splitext(out)[0] + ".md", markdown(rows).encode())


if __name__ == "__main__":
    sys.exit(main())
