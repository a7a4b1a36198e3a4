"""What refusing hostile NIR files costs: time and peak memory of each refusal, in a fresh process.

    python -m benchmarks interop nir_file_limits [--unused-gib 1.5] [--chains 1000 10000] [--out FILE.json]

Cases (each run by ``load_nir`` in its own subprocess; ``peak_mib`` is that process's
``ru_maxrss`` growth during ``load_nir``, ``maxrss_mib`` its whole peak, imports included):

- ``unused``: a small valid file plus an unused chunked, gzip-compressed float32 dataset of
  ``--unused-gib`` GiB (of zeros: a few MiB on disk) inside a node.
- ``chain N``: an input -> N Linear(2x2) -> output chain: refused by the node cap at N = 10,000,
  and loaded with the cap raised at N = 1,000 .. 8,000 (load time per node shows it is linear).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

from ..common import child_env, test_helper

_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from snnconv.errors import NIRError
from snnconv.snn.nir_io import load_nir
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    graph = load_nir(sys.argv[1], **json.loads(sys.argv[2]))
    outcome = f"loaded, {len(graph.nodes)} nodes"
except NIRError as exc:
    outcome = "refused: " + str(exc).split(": ", 1)[1][:160]
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps({"seconds": round(seconds, 4), "peak_mib": round(peak / 1024, 1),
                  "maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "outcome": outcome}))
"""


def _measure(path: str, **kw) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path, json.dumps(kw)], check=True,
                         capture_output=True, text=True, env=child_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def _unused_file(folder: str, gib: float) -> str:
    tiny_graph = test_helper("_nirfiles").tiny_graph

    from snnconv.snn.nir_io import save_nir

    path = os.path.join(folder, "unused.nir")
    save_nir(tiny_graph(), path)
    rows = int(gib * 2**30 / 4 / 4096)
    block = np.zeros((1024, 4096), np.float32)
    with h5py.File(path, "a") as f:
        ds = f.create_dataset("node/nodes/fc1/unused", shape=(rows, 4096), dtype=np.float32,
                              chunks=(256, 4096), compression="gzip")
        for i in range(0, rows, 1024):
            ds[i:i + 1024] = block[: min(1024, rows - i)]
    return path


def _chain_file(folder: str, n: int) -> str:
    chain_graph = test_helper("_nirfiles").chain_graph

    from snnconv.snn.nir_io import save_nir

    path = os.path.join(folder, f"chain{n}.nir")
    save_nir(chain_graph(n), path, compression=None)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unused-gib", type=float, default=1.5)
    parser.add_argument("--chains", type=int, nargs="*", default=[1000, 2000, 4000, 8000, 10000])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        path = _unused_file(folder, args.unused_gib)
        results["unused"] = {"declared_gib": args.unused_gib,
                             "file_mib": round(os.path.getsize(path) / 2**20, 2),
                             "write_seconds": round(time.perf_counter() - t, 1), **_measure(path)}
        print("unused", results["unused"], flush=True)
        for n in args.chains:
            path = _chain_file(folder, n)
            row = {"file_mib": round(os.path.getsize(path) / 2**20, 2),
                   "default_caps": _measure(path),
                   "cap_raised": _measure(path, max_nodes=n + 2, max_edges=n + 1)}
            row["cap_raised"]["ms_per_node"] = round(1000 * row["cap_raised"]["seconds"] / n, 3)
            results[f"chain {n}"] = row
            print(f"chain {n}", row, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
