"""Hostile NIR files, written as an attacker who has read the source would: every file that
carries a digest gets it recomputed (the digest is public), so only the reader's own checks
stand between the file and the caller.

Used by tests/test_nir_file.py, tests/test_nir_file_fuzz.py and benchmarks/interop/nir_file_attacks.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import h5py
import nir
import numpy as np

from snnconv.nir.format import ANALOG_PREFIX, INPUT_KEY, PREFIX_FILE_KEY, PREFIX_SHA256_KEY

DIGEST_KEY = "snnconv_digest"  # spelled out: the attacker reads it in the file
VERSION_KEY = "snnconv_nir_version"


@dataclass(frozen=True)
class Zeros:
    """An array of zeros the attacker knows the content of without holding it in memory."""

    shape: tuple[int, ...]
    dtype: str


def _tag(h: Any, tag: bytes, payload: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(payload)) + payload)


def _feed(h: Any, value: Any) -> None:
    """snnconv.io.digest.content_digest's encoding, with :class:`Zeros` hashed in blocks (checked
    against content_digest by test_the_attackers_digest_is_snnconvs)."""
    if isinstance(value, Zeros):
        dtype = np.dtype(value.dtype)
        n = int(np.prod(value.shape, dtype=np.int64)) * dtype.itemsize
        _tag(h, b"a", f"{dtype.str}{tuple(value.shape)}".encode())
        h.update(b"v" + struct.pack("<Q", n))
        block = bytes(min(n, 2**24))
        while n > 0:
            h.update(block[:min(n, len(block))])
            n -= len(block)
    elif isinstance(value, dict):
        _tag(h, b"d", str(len(value)).encode())
        for key in sorted(value, key=str):
            _tag(h, b"k", str(key).encode("utf-8"))
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        _tag(h, b"l", str(len(value)).encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, (str, bytes)):
        _tag(h, b"s", value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, np.ndarray) and value.dtype.kind == "O":
        _tag(h, b"o", str(value.shape).encode())
        for item in value.reshape(-1):
            _feed(h, item)
    elif isinstance(value, (np.generic, np.ndarray)):
        a = np.ascontiguousarray(np.asarray(value))
        _tag(h, b"a", f"{a.dtype.str}{a.shape}".encode())
        _tag(h, b"v", a.tobytes())
    else:
        raise TypeError(type(value).__name__)


def digest(tree: Any) -> str:
    h = hashlib.sha256()
    _feed(h, tree)
    return "sha256:" + h.hexdigest()


def plain_tree(group: Any, known: dict[str, Any]) -> dict[str, Any]:
    """A group as snnconv's reader sees it (bytes scalars decoded); ``known``: values by full
    dataset name that the attacker does not read (their content is known)."""
    out: dict[str, Any] = {}
    for key, item in group.items():
        if item.name in known:
            out[key] = known[item.name]
        elif isinstance(item, h5py.Group):
            out[key] = plain_tree(item, known)
        else:
            value = item[()]
            out[key] = value.decode("utf8") if isinstance(value, bytes) else value
    return out


def forge(path: str | os.PathLike, known: dict[str, Any] | None = None, record_version: bool = True) -> None:
    """Recompute the digest of the file at ``path`` as save_nir would (recording ``/version``
    under it unless ``record_version`` is False, as snnconv did before)."""
    known = dict(known or {})
    with h5py.File(path, "a") as f:
        meta = f["node"].require_group("metadata")
        for key in (DIGEST_KEY, VERSION_KEY):
            if key in meta:
                del meta[key]
        if record_version:
            version = known.get("/version", None)
            version = f["version"][()] if version is None else version
            meta.create_dataset(VERSION_KEY, data=version, dtype=h5py.string_dtype())
        tree = plain_tree(f["node"], known)
        meta.create_dataset(DIGEST_KEY, data=digest(tree), dtype=h5py.string_dtype())


def write_plain(graph: nir.NIRGraph, path: str | os.PathLike, compression: str | None = None) -> None:
    """``nir.write`` of ``graph`` with the digest forged: what save_nir writes, without its check
    that the graph is one snnconv reads."""
    buf = io.BytesIO()
    nir.write(buf, graph, compression=compression)
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())
    forge(path)


# --- the graphs --------------------------------------------------------------------------------

def dense_graph(n_in: int, n_out: int, dtype: Any = np.float32) -> nir.NIRGraph:
    """input(n_in) -> Linear(n_out, n_in) -> output(n_out), weight of ones."""
    return nir.NIRGraph(nodes={"input": nir.Input(np.array([n_in])),
                               "fc": nir.Linear(weight=np.ones((n_out, n_in), dtype)),
                               "output": nir.Output(np.array([n_out]))},
                        edges=[("input", "fc"), ("fc", "output")], metadata={"T": 4},
                        type_check=False)


def two_neuron_graph(extra_edge: tuple[str, str] | None = None) -> nir.NIRGraph:
    """input(3) -> fc1 -> n1 -> fc2 -> n2 -> fc3 -> output(2), both subtractive neurons, plus
    ``extra_edge``."""
    from snnconv.nir.format import fire_threshold, graph_metadata, neuron_metadata, spec_threshold

    rng = np.random.default_rng(1)
    theta = np.full(4, 0.75, np.float32)
    nodes: dict[str, Any] = {"input": nir.Input(np.array([3])),
                             "fc1": nir.Affine(weight=rng.standard_normal((4, 3)).astype(np.float32),
                                               bias=rng.standard_normal(4).astype(np.float32)),
                             "fc2": nir.Linear(weight=rng.standard_normal((4, 4)).astype(np.float32)),
                             "fc3": nir.Linear(weight=rng.standard_normal((2, 4)).astype(np.float32)),
                             "output": nir.Output(np.array([2]))}
    edges = [("input", "fc1"), ("fc2", "n2"), ("fc3", "output")]
    for n, src, dst in (("n1", "fc1", "fc2"), ("n2", "fc2", "fc3")):
        nodes[n] = nir.I(r=np.ones(4, np.float32), metadata=neuron_metadata("subtract", 0.5, False))
        nodes[f"{n}_fire"] = nir.Threshold(spec_threshold(fire_threshold(theta, np.float32(0.5))))
        nodes[f"{n}_reset"] = nir.Scale(-theta)
        edges += [(src, n), (n, f"{n}_fire"), (f"{n}_fire", f"{n}_reset"), (f"{n}_reset", n),
                  (f"{n}_fire", dst)]
    edges = list(dict.fromkeys(edges))
    if extra_edge:
        edges.append(extra_edge)
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=graph_metadata(4, "subtract"),
                        type_check=False)


# --- the attacks (each writes one file and returns its path) ------------------------------------

def string_bomb(folder: str, where: str, length: int = 2_000_000_000) -> str:
    """A fixed-length string dataset of ``length`` bytes, never written (a few KiB of file):
    ``where`` is "metadata" (a new entry), "type" (a node's type), "version" or "edges"."""
    from _nirfiles import tiny_graph

    path = os.path.join(folder, f"string_{where}.nir")
    write_plain(tiny_graph(), path)
    dtype = f"S{length}"
    known: dict[str, Any] = {}
    with h5py.File(path, "a") as f:
        if where == "metadata":
            f.create_dataset("node/metadata/note", shape=(), dtype=dtype)
            known["/node/metadata/note"] = ""
        elif where == "type":
            del f["node/nodes/fc1/type"]
            f.create_dataset("node/nodes/fc1/type", shape=(), dtype=dtype)
            known["/node/nodes/fc1/type"] = ""
        elif where == "version":
            del f["version"]
            f.create_dataset("version", shape=(), dtype=dtype)
            known["/version"] = ""
        else:
            edges = f["node/edges"][()]
            del f["node/edges"]
            f.create_dataset("node/edges", shape=edges.shape, dtype=f"S{length // 8}")
            known["/node/edges"] = np.full(edges.shape, b"", dtype=object)
    forge(path, known)
    return path


def chunk_bomb(folder: str, n: int = 2**18) -> str:
    """A Linear weight (3, n) float32 in one-element chunks, never written."""
    path = os.path.join(folder, f"chunks_{n}.nir")
    write_plain(dense_graph(n, 3), path)
    with h5py.File(path, "a") as f:
        del f["node/nodes/fc/weight"]
        f.create_dataset("node/nodes/fc/weight", shape=(3, n), dtype=np.float32, chunks=(1, 1))
    forge(path, {"/node/nodes/fc/weight": Zeros((3, n), "<f4")})
    return path


def gzip_bomb(folder: str, rows: int = 2**14, cols: int = 2**14 - 64) -> str:
    """A Linear weight (rows, cols) float64 of zeros, gzip-compressed (about 2 MB of file for
    2.1 GB of values: under the value cap of 2**28, over the byte budget)."""
    path = os.path.join(folder, "gzip.nir")
    write_plain(dense_graph(2, 2), path)
    chunk = (64, cols)
    packed = zlib.compress(bytes(8 * chunk[0] * chunk[1]), 9)
    with h5py.File(path, "a") as f:
        group = f["node/nodes"]
        for name in ("input", "fc", "output"):
            del group[name]
        g = group.create_group("input")
        g["type"], g["shape"] = "Input", np.array([cols])
        g = group.create_group("output")
        g["type"], g["shape"] = "Output", np.array([rows])
        g = group.create_group("fc")
        g["type"] = "Linear"
        ds = g.create_dataset("weight", shape=(rows, cols), dtype=np.float64, chunks=chunk,
                              compression="gzip")
        for r in range(0, rows, chunk[0]):
            ds.id.write_direct_chunk((r, 0), packed)
    forge(path, {"/node/nodes/fc/weight": Zeros((rows, cols), "<f8")})
    return path


def metadata_T(folder: str, value: float) -> str:
    """The tiny graph with graph metadata ``T = value`` (NaN, inf)."""
    from _nirfiles import tiny_graph

    path = os.path.join(folder, f"T_{value}.nir")
    graph = tiny_graph()
    graph.metadata["T"] = value
    write_plain(graph, path)
    return path


def deep_metadata(folder: str, depth: int = 5000) -> str:
    """The tiny graph with node metadata groups nested ``depth`` deep (the digest left as it was:
    the nesting alone is the attack)."""
    from _nirfiles import tiny_graph

    path = os.path.join(folder, f"deep_{depth}.nir")
    write_plain(tiny_graph(), path)
    with h5py.File(path, "a") as f:
        g = f["node/nodes/fc1"].require_group("metadata")
        for _ in range(depth):
            g = g.create_group("m")
    return path


def prefix_graph_file(folder: str, prefix_name: str, sha256: str = "0" * 64) -> str:
    """The tiny graph reading an analog prefix saved as ``prefix_name`` beside it."""
    from _nirfiles import tiny_graph

    path = os.path.join(folder, "prefixed.nir")
    graph = tiny_graph()
    graph.metadata.update({INPUT_KEY: ANALOG_PREFIX, PREFIX_FILE_KEY: prefix_name,
                           PREFIX_SHA256_KEY: sha256})
    write_plain(graph, path)
    return path
