"""One reader's fuzz cases, run in a child process capped in memory and time (by
tests/test_nir_file_fuzz.py): ``python _fuzz_readers.py READER FOLDER``.

Readers: ``nirfile`` (load_nir on mutants of small valid files and on the known hostile files,
digests forged), ``nirgraph`` (parse on mutated graphs) and ``prefix`` (load_prefix on every kind
of path and on mutated prefix files, SHA-256 forged). Per case it prints one JSON line: the case,
its outcome ("loaded" or the snnconv error's class; "RAW <class>" for anything else), the peak
resident memory the case added (VmHWM, reset before each case) and whether the marker file a
payload would create exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import resource
import signal
import socket
import sys
import warnings
import zipfile

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _nirattacks as attacks  # noqa: E402
from _nirfiles import tiny_graph  # noqa: E402

CASE_SECONDS = 10
MEMORY_CAP = 2 * 2**30  # above the size after imports


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(fh.read().split(key + ":")[1].split()[0]) * 1024


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_case(name: str, fn, marker: str) -> dict:
    from snnconv.errors import SnnconvError

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status("VmRSS")
    signal.alarm(CASE_SECONDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        outcome = "loaded"
    except SnnconvError as exc:
        outcome = type(exc).__name__
    except _Timeout:
        outcome = f"RAW timeout after {CASE_SECONDS} s"
    except BaseException as exc:  # noqa: BLE001 (what the parent asserts never happens)
        outcome = f"RAW {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.alarm(0)
    row = {"case": name, "outcome": outcome, "peak": max(0, _status("VmHWM") - before),
           "code_ran": os.path.exists(marker)}
    print(json.dumps(row), flush=True)
    return row


def _payload(marker: str) -> str:
    return f"__import__('os').system('touch {marker}')"


# --- load_nir ------------------------------------------------------------------------------

def _mutants(folder: str, marker: str):
    """(name, path) of mutants of the tiny files: byte damage (digest left), structural edits
    and payloads (digest forged)."""
    from snnconv.nir_io import save_nir

    rng = random.Random(0)
    pristine = {}
    for reset in ("subtract", "zero"):
        path = os.path.join(folder, f"{reset}.nir")
        save_nir(tiny_graph(reset), path)
        pristine[reset] = open(path, "rb").read()
    for i in range(60):
        reset = rng.choice(["subtract", "zero"])
        data = bytearray(pristine[reset])
        path = os.path.join(folder, f"m{i}.nir")
        kind = rng.choice(["truncate", "flip", "flip", "structure", "payload", "value"])
        if kind == "truncate":
            del data[rng.randrange(len(data)):]
        elif kind == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        with open(path, "wb") as fh:
            fh.write(bytes(data))
        if kind in ("structure", "payload", "value"):
            with h5py.File(path, "a") as f:
                names: list[str] = []
                f.visit(names.append)
                datasets = [n for n in names if isinstance(f[n], h5py.Dataset)
                            and "snnconv_digest" not in n and n != "version"]
                target = rng.choice(datasets)
                if kind == "structure":
                    op = rng.choice(["remove", "shape", "dtype", "text"])
                    value = f[target][()]
                    del f[target]
                    if op == "shape":
                        f[target] = np.asarray(value).reshape(-1)[:1].repeat(rng.randint(0, 9))
                    elif op == "dtype":
                        f[target] = np.asarray(value, dtype=rng.choice(["<f8", "<i8", "|u1", "<f2"])) \
                            if np.asarray(value).dtype.kind in "fiu" else np.float32(1)
                    elif op == "text":
                        f.create_dataset(target, data="x" * rng.randint(0, 70000),
                                         dtype=h5py.string_dtype())
                elif kind == "payload":
                    where = rng.choice(["node/metadata/note", "node/nodes/fc1/metadata/x",
                                        "node/nodes/fc1/type"])
                    if where in f:
                        del f[where]
                    f.create_dataset(where, data=_payload(marker), dtype=h5py.string_dtype())
                else:
                    arr = f[target][()]
                    if isinstance(arr, np.ndarray) and arr.dtype.kind == "f" and arr.size:
                        arr = arr.copy()
                        arr.reshape(-1)[rng.randrange(arr.size)] = rng.choice(
                            [np.nan, np.inf, -1.0, 0.0, 1e30, -1e-30])
                        del f[target]
                        f[target] = arr
            attacks.forge(path)
        yield f"mutant {i} ({kind})", path


def fuzz_nirfile(folder: str, marker: str) -> None:
    from snnconv.nir_io import load_nir

    for name, path in _mutants(folder, marker):
        run_case(name, lambda p=path: load_nir(p), marker)
    hostile = [(f"string bomb in {w}", attacks.string_bomb(folder, w))
               for w in ("metadata", "type", "version", "edges")]
    hostile += [("chunk bomb", attacks.chunk_bomb(folder)), ("gzip bomb", attacks.gzip_bomb(folder)),
                ("T nan", attacks.metadata_T(folder, float("nan"))),
                ("T inf", attacks.metadata_T(folder, float("inf"))),
                ("deep metadata", attacks.deep_metadata(folder, 2000))]
    for name, path in hostile:
        run_case(name, lambda p=path: load_nir(p), marker)
    fifo = os.path.join(folder, "fifo.nir")
    os.mkfifo(fifo)
    run_case("NIR path is a FIFO", lambda: load_nir(fifo), marker)
    run_case("NIR path is /dev/zero", lambda: load_nir("/dev/zero"), marker)


# --- parse ---------------------------------------------------------------------------------

def _accounted(graph, parsed) -> None:
    """Every edge of ``graph`` is an op's input or a neuron pattern's own edge (none dropped)."""
    alias = {}
    internal = set()
    for op in parsed.ops:
        if op.kind == "neuron" and op.params["reset"] == "subtract":
            fire = next(d for s, d in graph.edges if s == op.name)
            reset = next(d for s, d in graph.edges if s == fire and d != op.name
                         and type(graph.nodes[d]).__name__ == "Scale"
                         and (fire, d) in graph.edges and (d, op.name) in graph.edges)
            alias[fire] = op.name
            internal |= {(op.name, fire), (fire, reset), (reset, op.name)}
    inputs = {(s, op.name) for op in parsed.ops for s in op.inputs}
    for s, d in graph.edges:
        if (s, d) not in internal:
            assert (alias.get(s, s), d) in inputs, f"edge {s} -> {d} was dropped"


def fuzz_nirgraph(folder: str, marker: str) -> None:
    from snnconv_backends.nirgraph import parse

    rng = random.Random(1)
    values = [float("nan"), float("inf"), -1, 0, 2**70, "x", _payload(marker), [1, 2], {"a": {}}, None]
    for i in range(150):
        graph = attacks.two_neuron_graph() if rng.random() < 0.6 else tiny_graph(rng.choice(["subtract", "zero"]))
        names = list(graph.nodes)
        kind = rng.choice(["add edge", "add edge", "drop edge", "reverse edge", "graph meta", "node meta",
                           "neuron edge"])
        if kind == "add edge":
            graph.edges.append((rng.choice(names), rng.choice(names)))
        elif kind == "neuron edge":  # from a neuron's hidden node into a node of a neuron
            hidden = [n for n in names if n.endswith(("_fire", "_reset"))]
            graph.edges.append((rng.choice(hidden), rng.choice([n for n in names if n.startswith("n")])))
        elif kind == "drop edge":
            graph.edges.pop(rng.randrange(len(graph.edges)))
        elif kind == "reverse edge":
            j = rng.randrange(len(graph.edges))
            graph.edges[j] = graph.edges[j][::-1]
        elif kind == "graph meta":
            graph.metadata[rng.choice(["T", "reset", "snnconv_format", "nir_file_version", "x"])] = \
                rng.choice(values)
        else:
            node = graph.nodes[rng.choice(names)]
            node.metadata = {**(node.metadata or {}),
                             rng.choice(["compare", "reset", "v_init", "threshold", "snnconv_op"]):
                             rng.choice(values)}

        def check(g=graph):
            _accounted(g, parse(g))

        run_case(f"graph {i} ({kind})", check, marker)


# --- load_prefix -----------------------------------------------------------------------------

def _prefix_bytes() -> bytes:
    import torch.fx as fx
    import torch.nn as nn

    from snnconv.network import SpikingNetwork
    from snnconv.nirformat import ANALOG_PREFIX

    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    for name, module in (("conv", nn.Conv2d(1, 2, 3)), ("relu", nn.ReLU()), ("pool", nn.MaxPool2d(2))):
        root.add_module(name, module)
        x = g.call_module(name, (x,))
    g.output(x)
    net = SpikingNetwork(fx.GraphModule(root, g, "AnalogPrefixGraph"), T=1)
    net.meta = {"input_shape": [1, 8, 8], "role": ANALOG_PREFIX, "output_shape": [2, 3, 3]}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        net.save(os.path.join(tmp, "p.pt"))
        with open(os.path.join(tmp, "p.pt"), "rb") as fh:
            return fh.read()


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def fuzz_prefix(folder: str, marker: str) -> None:
    from snnconv.nir_io import load_nir
    from snnconv.prefixfile import load_prefix

    import torch

    from snnconv.network import SpikingNetwork

    good = _prefix_bytes()
    reference = SpikingNetwork.load(io.BytesIO(good))
    rng = random.Random(2)
    cases: list[tuple[str, str, bytes | None]] = []  # (case, file name, content to write or None)
    for i in range(25):
        data = bytearray(good)
        if i % 2:
            del data[rng.randrange(len(data)):]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        cases.append((f"prefix mutant {i}", f"m{i}.pt", bytes(data)))
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"meta": _Evil(marker)}, protocol=2))
    cases += [("pickle payload", "evil.pt", evil.getvalue()), ("the valid prefix", "ok.pt", good),
              ("raw pickle", "raw.pt", pickle.dumps(_Evil(marker)))]
    specials = {"FIFO": "fifo.pt", "/dev/zero": "zero.pt", "folder": "dir.pt", "socket": "sock.pt",
                "missing": "missing.pt", "sparse 1 TiB file": "huge.pt", "../ in the name": "../x.pt",
                "absolute name": "/etc/passwd"}
    os.mkfifo(os.path.join(folder, "fifo.pt"))
    os.symlink("/dev/zero", os.path.join(folder, "zero.pt"))
    os.mkdir(os.path.join(folder, "dir.pt"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(folder, "sock.pt"))
    with open(os.path.join(folder, "huge.pt"), "wb") as fh:
        fh.truncate(2**40)
    cases += [(f"prefix is {k}", v, None) for k, v in specials.items()]
    for case, name, content in cases:
        sub = os.path.join(folder, f"c{len(os.listdir(folder))}")
        os.mkdir(sub)
        sha = "0" * 64
        if content is not None:
            with open(os.path.join(sub, name), "wb") as fh:
                fh.write(content)
            sha = hashlib.sha256(content).hexdigest()  # the attacker's
        else:
            if not name.startswith(("/", "..")):
                os.symlink(os.path.join(folder, name), os.path.join(sub, name))
        path = attacks.prefix_graph_file(sub, name, sha)

        def check(p=path, case=case):
            net = load_prefix(load_nir(p), p)  # a load must be the valid prefix's network
            got, want = net.state_dict(), reference.state_dict()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), case

        run_case(case, check, marker)


if __name__ == "__main__":
    reader, folder = sys.argv[1], sys.argv[2]
    marker = os.path.join(folder, "CODE_RAN")
    cap = _status("VmSize") + MEMORY_CAP
    # the cap applies from here: the imports the readers need are loaded first
    import snnconv.nir_io  # noqa: F401
    import snnconv.prefixfile  # noqa: F401
    import snnconv_backends.nirgraph  # noqa: F401

    cap = _status("VmSize") + MEMORY_CAP
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGALRM, _alarm)
    {"nirfile": fuzz_nirfile, "nirgraph": fuzz_nirgraph, "prefix": fuzz_prefix}[reader](folder, marker)
