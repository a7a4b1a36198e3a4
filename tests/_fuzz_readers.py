"""One reader's fuzz cases, run in a child process capped in memory and time (by
tests/test_nir_file_fuzz.py): ``python _fuzz_readers.py READER FOLDER``.

Readers: ``nirfile`` (load_nir on mutants of small valid files and on the known hostile files,
digests forged), ``nirgraph`` (parse on mutated graphs), ``prefix`` (load_prefix on every kind
of path and on mutated prefix files, SHA-256 forged), ``network`` (SpikingNetwork.load on
mutants of a small network file: bytes, graph records, values, fields; digests forged) and
``checkpoint`` (read_checkpoint and its field checks on mutated records, SHA-256 forged). Per case it prints
one JSON line: the case,
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

CASE_SECONDS = 20  # CPU seconds (ITIMER_PROF), not wall time
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
    signal.setitimer(signal.ITIMER_PROF, CASE_SECONDS)  # CPU seconds: a loaded machine is no hang
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        outcome = "loaded"
    except SnnconvError as exc:
        outcome = type(exc).__name__
    except _Timeout:
        outcome = f"RAW timeout after {CASE_SECONDS} CPU s"
    except BaseException as exc:  # noqa: BLE001 (what the parent asserts never happens)
        outcome = f"RAW {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
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
    from snnconv.snn.nir_io import save_nir

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
    from snnconv.snn.nir_io import load_nir

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
    from snnconv.nir.reader import parse

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

    from snnconv.nir.format import ANALOG_PREFIX
    from snnconv.snn.network import SpikingNetwork

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
    import torch

    from snnconv.snn.network import SpikingNetwork
    from snnconv.snn.nir_io import load_nir
    from snnconv.snn.prefixfile import load_prefix

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


# --- SpikingNetwork.load and fine-tuning checkpoints -------------------------------------------

def _small_network():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import snnconv

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.pool = nn.Conv2d(1, 4, 3, padding=1), nn.MaxPool2d(2)
            self.a, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 3)

        def forward(self, x):
            x = self.pool(F.relu(self.conv1(x)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.a(x)) + x, 1), 1))

    torch.manual_seed(0)
    x = torch.rand(8, 1, 8, 8)
    snn, _ = snnconv.convert(Net().eval(), [(x, torch.zeros(8, dtype=torch.long))], T=2, finetune_epochs=0,
                             reconstruction_steps=0, progress=False, on_collapse="warn")
    return snn, x


def _graph_mutation(graph: dict, rng: random.Random, marker: str) -> None:
    """One field of a node or module record replaced by a hostile or malformed value."""
    code = _payload(marker)
    values = [f"x, __z={code}", code, f'a"){code}+("', "__class__", "builtins.eval", "os.system",
              "torch.load", 123, -1, None, 1e300, float("nan"), {"node": "nowhere"}, {"tuple": [code]},
              {"dict": {f"__z={code}, dim": 1}}, {"tuple": [{"tuple": [{"tuple": []}]}] * 3}, [], {},
              "get_attr", "call_method", "output", "placeholder", "fc", "x"]
    nested = [m["graph"] for m in graph["modules"].values() if m.get("type") == "AnalogPrefix"]
    g = rng.choice([graph] + nested)
    if rng.random() < 0.7 or not g["modules"]:
        rec = rng.choice(g["nodes"])
        rec[rng.choice(["op", "name", "target", "args", "kwargs"])] = rng.choice(values)
    else:
        name = rng.choice(list(g["modules"]))
        spec = g["modules"][name]
        if rng.random() < 0.3:
            g["modules"][rng.choice([f"x{code}", "__class__", "training", "a.b"])] = g["modules"].pop(name)
        elif "config" in spec and spec["config"]:
            spec["config"][rng.choice(list(spec["config"]) + ["evil"])] = rng.choice(
                values + [2**40, (2**20, 2**20), -5])
        else:
            spec["type"] = rng.choice(["Evil", "Linear", "AnalogPrefix", code])


def fuzz_network(folder: str, marker: str) -> None:
    import torch

    from snnconv.io.digest import content_digest
    from snnconv.snn.network import SpikingNetwork

    snn, x = _small_network()
    path = os.path.join(folder, "snn.pt")
    snn.save(path)
    good = open(path, "rb").read()
    with torch.no_grad():
        want = snn(x)
    rng = random.Random(3)

    def check(p, same=True):
        with torch.no_grad():
            got = SpikingNetwork.load(p)(x)  # it runs: a forged file is a network of its own
        if same:  # damaged bytes under the old digest: a load must be the saved network
            assert torch.equal(got, want)

    for i in range(120):
        target = os.path.join(folder, f"m{i}.pt")
        kind = rng.choice(["bytes", "graph", "graph", "graph", "values", "payload"])
        if kind == "bytes":
            data = bytearray(good)
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            open(target, "wb").write(bytes(data))
        else:
            payload = torch.load(io.BytesIO(good), weights_only=True)
            if kind == "graph":
                for _ in range(rng.randint(1, 3)):
                    _graph_mutation(payload["graph"], rng, marker)
            elif kind == "values":
                key = rng.choice(list(payload["state_dict"]))
                t = payload["state_dict"][key].clone()
                t.reshape(-1)[rng.randrange(max(1, t.numel()))] = rng.choice(
                    [float("nan"), float("inf"), -1.0, 0.0, 1e30])
                payload["state_dict"][key] = t
            else:
                payload[rng.choice(["meta", "T", "version", "format"])] = rng.choice(
                    [_payload(marker), float("nan"), 10**9, -1, {"a": [_payload(marker)] * 3}, None])
            try:
                payload["digest"] = content_digest({k: v for k, v in payload.items() if k != "digest"})
            except Exception:  # noqa: BLE001 (what cannot be digested keeps the old digest)
                pass
            buf = io.BytesIO()
            torch.save(payload, buf)
            open(target, "wb").write(buf.getvalue())
        run_case(f"network mutant {i} ({kind})", lambda p=target, k=kind: check(p, k == "bytes"), marker)
    run_case("the valid network", lambda: check(path), marker)


def fuzz_checkpoint(folder: str, marker: str) -> None:
    import torch

    from snnconv.io.checkpoint import check_checkpoint, read_checkpoint, write_checkpoint
    from snnconv.stages.finetune import CHECKPOINT_NAME, finetune

    snn, x = _small_network()
    batches = [(x, torch.randint(0, 3, (8,))) for _ in range(2)]
    finetune(snn, batches, T=2, epochs=2, max_steps_per_epoch=1, checkpoint_dir=folder, progress=False)
    path = os.path.join(folder, CHECKPOINT_NAME)
    good = read_checkpoint(path)
    rng = random.Random(4)
    odd = [-1, 10**9, 0.5, "1", True, None, float("nan"), [], {}, "x" * 100, [1, 2], {"cpu": 1},
           torch.zeros(3), {"a": torch.zeros(2)}, _payload(marker)]
    for i in range(60):
        state = dict(good)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(list(state))
            if rng.random() < 0.15:
                del state[key]
            else:
                state[key] = rng.choice(odd)
        target = os.path.join(folder, f"c{i}.ckpt")
        write_checkpoint(target, state)  # the SHA-256 an attacker recomputes

        def check(p=target):
            loaded = read_checkpoint(p)
            check_checkpoint(p, loaded, snn, 2, 1)
            snn.load_state_dict(loaded["model"])

        run_case(f"checkpoint mutant {i}", check, marker)
    run_case("the valid checkpoint", lambda: check_checkpoint(path, read_checkpoint(path), snn, 2, 1), marker)


if __name__ == "__main__":
    reader, folder = sys.argv[1], sys.argv[2]
    marker = os.path.join(folder, "CODE_RAN")
    cap = _status("VmSize") + MEMORY_CAP
    # the cap applies from here: the imports the readers need are loaded first
    import snnconv.nir.reader  # noqa: F401
    import snnconv.snn.nir_io  # noqa: F401
    import snnconv.snn.prefixfile  # noqa: F401
    import snnconv.stages.finetune  # noqa: F401

    cap = _status("VmSize") + MEMORY_CAP
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGPROF, _alarm)
    {"nirfile": fuzz_nirfile, "nirgraph": fuzz_nirgraph, "prefix": fuzz_prefix, "network": fuzz_network,
     "checkpoint": fuzz_checkpoint}[reader](folder, marker)
