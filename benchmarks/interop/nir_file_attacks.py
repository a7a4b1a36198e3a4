"""Hostile NIR and prefix files: what each costs the reader, in
a fresh process per file.

    python -m benchmarks interop nir_file_attacks [--code DIR] [--cap-gib 8] [--out FILE.json]

Every file carries a digest recomputed as an attacker would (``tests/_nirattacks.py``). Each
case runs ``load_nir`` (and, for the prefix cases, ``load_prefix``) in a child process whose
address space is capped at its size after imports plus ``--cap-gib``, with a 60 s timeout;
``peak_mib`` is the child's peak resident memory growth during the call (``VmHWM`` after a
reset through ``/proc/self/clear_refs``: ``ru_maxrss`` carries the parent's peak across exec). ``--code DIR`` runs the
children against another checkout (e.g. ``git archive <commit> | tar -x -C DIR``) to measure
the code before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from ..common import ROOT, test_helper

_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from snnconv.errors import SnnconvError
from snnconv.snn.nir_io import load_nir
from snnconv.snn.prefixfile import load_prefix
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
cap = vm + int(float(sys.argv[3]) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS (ru_maxrss survives exec)
base = status("VmRSS")
start = time.perf_counter()
try:
    graph = load_nir(sys.argv[1])
    if sys.argv[2] == "prefix":
        load_prefix(graph, sys.argv[1])
    outcome = "loaded"
except SnnconvError as exc:
    outcome = f"{type(exc).__name__}: " + str(exc)[:300]
except BaseException as exc:
    outcome = f"RAW {type(exc).__name__}: " + str(exc)[:200]
seconds = time.perf_counter() - start
peak = status("VmHWM") - base
print(json.dumps({"seconds": round(seconds, 3), "peak_mib": round(peak / 1024, 1), "outcome": outcome}))
"""


def _run(code: str, path: str, mode: str, cap_gib: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, os.path.join(code, "backends")])}
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, path, mode, str(cap_gib)], env=env, cwd=code,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"seconds": 60.0, "peak_mib": None, "outcome": "HANG: killed after 60 s"}
    lines = out.stdout.strip().splitlines()
    if not lines:
        return {"seconds": None, "peak_mib": None, "outcome": f"CRASH rc={out.returncode}: "
                                                                 + out.stderr.strip()[-200:]}
    return json.loads(lines[-1])


def cases(folder: str) -> list[tuple[str, str, str]]:
    """(name, path, mode) of every attack."""
    A = test_helper("_nirattacks")

    out = []
    for where in ("metadata", "type", "version", "edges"):
        out.append((f"fixed-length string S2000000000 in {where}", A.string_bomb(folder, where), "nir"))
    out.append(("weight (3, 2**18) float32 in one-element chunks, unwritten", A.chunk_bomb(folder), "nir"))
    out.append(("gzip float64 weight (2**14, 2**14-64)", A.gzip_bomb(folder), "nir"))
    for value in (float("nan"), float("inf")):
        out.append((f"metadata T = {value}", A.metadata_T(folder, value), "nir"))
    out.append(("metadata nested 5,000 deep", A.deep_metadata(folder), "nir"))
    fifo_dir = os.path.join(folder, "fifo")
    os.makedirs(fifo_dir)
    os.mkfifo(os.path.join(fifo_dir, "fifo.pt"))
    out.append(("prefix file is a FIFO", A.prefix_graph_file(fifo_dir, "fifo.pt"), "prefix"))
    dev_dir = os.path.join(folder, "dev")
    os.makedirs(dev_dir)
    os.symlink("/dev/zero", os.path.join(dev_dir, "zero.pt"))
    out.append(("prefix file is /dev/zero (a symlink)", A.prefix_graph_file(dev_dir, "zero.pt"), "prefix"))
    return out


def vgg16_volume(folder: str) -> str:
    """A graph with VGG-16's 138.3 M float32 parameters (input(586) -> 25088 -> 4096 -> 4096 ->
    1000: 14.7 + 102.8 + 16.8 + 4.1 M weights), written by save_nir without compression."""
    import nir
    import numpy as np

    from snnconv.snn.nir_io import save_nir

    rng = np.random.default_rng(0)
    sizes = [586, 25088, 4096, 4096, 1000]
    nodes = {"input": nir.Input(np.array([sizes[0]])), "output": nir.Output(np.array([sizes[-1]]))}
    edges, prev = [], "input"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        nodes[f"fc{i}"] = nir.Linear(weight=rng.standard_normal((n_out, n_in), dtype=np.float32))
        edges.append((prev, f"fc{i}"))
        prev = f"fc{i}"
    edges.append((prev, "output"))
    path = os.path.join(folder, "vgg16_volume.nir")
    save_nir(nir.NIRGraph(nodes=nodes, edges=edges, metadata={"T": 4}, type_check=False), path,
             compression=None)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--code", default=ROOT, help="the checkout the children import snnconv from")
    p.add_argument("--cap-gib", type=float, default=8.0)
    p.add_argument("--admit", action="store_true", help="also load a graph of VGG-16's size")
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        todo = cases(folder)
        if args.admit:
            todo.append(("VGG-16's 138.3 M float32 parameters (553 MB), uncompressed",
                         vgg16_volume(folder), "nir"))
        for name, path, mode in todo:
            size = os.path.getsize(path) if os.path.isfile(path) else None
            r = {"case": name, "file_kib": round(size / 1024, 1) if size else None,
                 **_run(args.code, path, mode, args.cap_gib)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"code": args.code, "cap_gib": args.cap_gib, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
