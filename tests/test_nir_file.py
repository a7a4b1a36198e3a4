"""The NIR file reader and writer: only the file itself is read, declared sizes are checked
before any data, snnconv's files carry a digest, and T is bounded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tracemalloc
import warnings

import _nirattacks as attacks
import h5py
import nir
import numpy as np
import pytest
from _nirfiles import chain_graph, same_graph, tiny_graph

from snnconv.config import MAX_T
from snnconv.errors import NIRError
from snnconv.io.digest import UnverifiedFileWarning
from snnconv.nir.file import DIGEST_KEY, VERSION_KEY
from snnconv.snn.nir_io import load_nir, save_nir


def _saved(tmp_path, graph=None, name="net.nir", **kw):
    path = tmp_path / name
    save_nir(tiny_graph() if graph is None else graph, path, **kw)
    return path


def _foreign(tmp_path, name="theirs.nir"):
    """The tiny graph as another tool writes it: nir.write, no digest, no snnconv metadata."""
    graph = tiny_graph(reset="zero")
    graph.nodes["n1"].metadata = {}
    path = tmp_path / name
    nir.write(path, nir.NIRGraph(nodes=graph.nodes, edges=graph.edges, metadata={}, type_check=False))
    return path


def _quiet_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_nir(path, **kw)


# --- round trips and the digest ------------------------------------------------------------

@pytest.mark.parametrize("reset", ["subtract", "zero"])
@pytest.mark.parametrize("compression", ["gzip", None])
def test_our_file_loads_equal_without_warning(tmp_path, reset, compression):
    graph = tiny_graph(reset)
    before = dict(graph.metadata)
    path = _saved(tmp_path, graph, compression=compression)
    assert graph.metadata == before  # the digest goes to the file, not into the caller's graph
    with h5py.File(path) as f:
        assert f[f"node/metadata/{DIGEST_KEY}"][()].decode().startswith("sha256:")
    back = _quiet_load(path)
    assert DIGEST_KEY not in back.metadata and VERSION_KEY not in back.metadata
    reference = nir.read(path, type_check=False)  # nir's own reader, which follows anything
    assert reference.metadata.pop(VERSION_KEY) == nir.version
    del reference.metadata[DIGEST_KEY]
    assert same_graph(back, reference)


def test_other_tools_files_load_on_structure_alone(tmp_path):
    path = _foreign(tmp_path)
    assert same_graph(_quiet_load(path), nir.read(path, type_check=False))


def test_a_changed_value_in_our_file_is_refused(tmp_path):
    path = _saved(tmp_path, compression=None)
    with h5py.File(path, "a") as f:
        f["node/nodes/fc1/weight"][0, 0] += 1.0
    with pytest.raises(NIRError, match="changed after it was written"):
        load_nir(path)


def test_our_file_without_its_digest_loads_with_the_warning(tmp_path):
    path = _saved(tmp_path)
    expected = load_nir(path)
    with h5py.File(path, "a") as f:
        del f[f"node/metadata/{DIGEST_KEY}"]
    with pytest.warns(UnverifiedFileWarning, match="no content digest"):
        back = load_nir(path)
    assert same_graph(back, expected)


# --- only the file itself ------------------------------------------------------------------

def _redirect(path, other, how: str) -> None:
    """Make fc1's weight come from ``other`` (a file holding dataset 'w' of the same shape)."""
    with h5py.File(path, "a") as f:
        shape, dtype = f["node/nodes/fc1/weight"].shape, f["node/nodes/fc1/weight"].dtype
        del f["node/nodes/fc1/weight"]
        group = f["node/nodes/fc1"]
        if how == "external link":
            group["weight"] = h5py.ExternalLink(str(other), "/w")
        elif how == "soft link":
            group["weight"] = h5py.SoftLink("/node/nodes/fc2/weight")  # another node's data
        elif how == "external storage":
            raw = other.with_suffix(".raw")
            raw.write_bytes(np.full(shape, 7.0, dtype).tobytes())
            group.create_dataset("weight", shape=shape, dtype=dtype,
                                 external=[(str(raw), 0, h5py.h5f.UNLIMITED)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(other), "w", shape=shape)
            group.create_virtual_dataset("weight", layout)


@pytest.mark.parametrize("how, named", [("external link", "external link"), ("soft link", "soft link"),
                                        ("external storage", "external raw storage"),
                                        ("virtual", "virtual dataset")])
@pytest.mark.parametrize("whose", ["ours", "theirs"])
def test_data_from_other_files_is_refused_by_name(tmp_path, how, named, whose):
    path = _saved(tmp_path) if whose == "ours" else _foreign(tmp_path)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["w"] = np.full((4, 3), 7.0, np.float32)
    _redirect(path, other, how)
    with pytest.raises(NIRError, match=f"{named}.*reads only"):
        load_nir(path)


# --- declared sizes before data --------------------------------------------------------------

def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("where", ["node/nodes/fc1/unused", "node/unused", "unused",
                                   "node/nodes/fc1/metadata/unused", "node/metadata/unused"])
def test_an_unused_large_dataset_is_refused_without_reading_it(tmp_path, where):
    path = _saved(tmp_path)
    with h5py.File(path, "a") as f:  # 64 MiB declared, a few KiB stored
        f.create_dataset(where, data=np.zeros((4096, 4096), np.float32), chunks=(512, 512),
                         compression="gzip")
    assert path.stat().st_size < 2**20
    peak = _peak_bytes(lambda: pytest.raises(NIRError, load_nir, path))
    assert peak < 2**22, f"refusing allocated {peak} bytes"
    with pytest.raises(NIRError, match="unused"):
        load_nir(path)


def test_a_weight_larger_than_the_cap_is_refused_before_it_is_read(tmp_path):
    """A Linear of 16384 x 32768 (2 GiB of float32) declared in a file of a few KiB."""
    path = _saved(tmp_path)
    with h5py.File(path, "a") as f:
        del f["node/nodes/fc2/weight"]
        f.create_dataset("node/nodes/fc2/weight", shape=(2, 16384 * 32768 // 2), dtype=np.float32,
                         chunks=(1, 2**20), compression="gzip")  # nothing stored: fill values
    assert path.stat().st_size < 2**20
    peak = _peak_bytes(lambda: pytest.raises(NIRError, load_nir, path))
    assert peak < 2**22, f"refusing allocated {peak} bytes"
    with pytest.raises(NIRError, match=r"more than 268435456 values \(reached at '/node/nodes/fc2/"
                                       r"weight'\).*max_values"):
        load_nir(path)


def test_the_caps_are_keyword_arguments(tmp_path):
    path = _saved(tmp_path, chain_graph(30))  # 32 nodes, 31 edges, 30 * 4 + 2 values
    assert len(_quiet_load(path, max_nodes=32, max_edges=31, max_values=122).nodes) == 32
    for kw, match in [({"max_nodes": 31}, "max_nodes"), ({"max_edges": 30}, "max_edges"),
                      ({"max_values": 121}, "max_values")]:
        with pytest.raises(NIRError, match=match):
            load_nir(path, **kw)


@pytest.mark.parametrize("field, shape", [("node/nodes/fc1/bias", (5,)), ("node/nodes/fc1/weight", (4, 3, 1)),
                                          ("node/nodes/n1/r", (4, 1) * 5)])
def test_declared_shapes_must_fit_the_node(tmp_path, field, shape):
    path = _saved(tmp_path, tiny_graph("zero"))
    with h5py.File(path, "a") as f:
        del f[field]
        f.create_dataset(field, shape=shape, dtype=np.float32)
    with pytest.raises(NIRError, match=field.split("/")[-1]):
        load_nir(path)


def test_text_where_numbers_belong_is_refused(tmp_path):
    path = _saved(tmp_path)
    with h5py.File(path, "a") as f:
        del f["node/nodes/fc2/weight"]
        f.create_dataset("node/nodes/fc2/weight", data="__import__('os')", dtype=h5py.string_dtype())
    with pytest.raises(NIRError, match="holds text"):
        load_nir(path)


# --- T -------------------------------------------------------------------------------------

def test_a_declared_T_beyond_the_bound_is_refused_at_read_time(tmp_path):
    path = _saved(tmp_path, tiny_graph(T=10**9))
    with pytest.raises(NIRError, match=f"T=1000000000 is above the bound of {MAX_T}.*max_T"):
        load_nir(path)
    assert int(_quiet_load(path, max_T=10**9).metadata["T"]) == 10**9


def test_snnconv_run_refuses_a_file_declaring_T_beyond_the_bound(tmp_path, capsys):
    from snnconv.cli import main

    path = _saved(tmp_path, tiny_graph(T=10**9))
    assert main(["run", str(path), "--backend", "cpu", "--data", "digits"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "T=1000000000 is above the bound" in err[0]


# --- the attacker who knows the format (every digest forged: tests/_nirattacks.py) -----

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "backends"),
                                                     os.path.join(ROOT, "tests")])}

# loads each file in a child process capped at its size after imports plus 2 GiB; prints, per
# file, the error (or "loaded") and the peak resident memory the load added (VmHWM, reset per file)
_MEASURE = r"""
import json, resource, sys, warnings
warnings.simplefilter("ignore")
from snnconv.errors import SnnconvError
from snnconv.snn.nir_io import load_nir

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

cap = status("VmSize") + 2 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident size
    before = status("VmRSS")
    try:
        load_nir(path)
        outcome = "loaded"
    except SnnconvError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:
        outcome = f"RAW {type(exc).__name__}: {exc}"
    print(json.dumps({"path": path, "outcome": outcome, "peak": status("VmHWM") - before}), flush=True)
"""


def _measured_loads(paths: list[str]) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *paths], env=_ENV, capture_output=True,
                          text=True, timeout=120)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(paths), proc.stderr[-2000:]
    return {r["path"]: r for r in rows}


def test_the_attackers_digest_is_snnconvs(tmp_path):
    from snnconv.io.digest import content_digest

    tree = {"a": np.zeros((3, 5), np.float64), "b": ["x", b"y", np.float32(2)], "c": {"d": "e"}}
    assert attacks.digest(tree) == content_digest(tree)
    assert attacks.digest({**tree, "a": attacks.Zeros((3, 5), "<f8")}) == content_digest(tree)
    path = tmp_path / "plain.nir"
    attacks.write_plain(tiny_graph(), path)  # a forged file loads like save_nir's own
    assert same_graph(_quiet_load(path), load_nir(_saved(tmp_path)))


def test_small_files_declaring_large_allocations_are_refused_before_reading(tmp_path):
    """KiB-sized files that made load_nir allocate 2.3-6.8 GB, digests forged."""
    expected = {attacks.string_bomb(str(tmp_path), w): f"fixed-length string.* {n} bytes"
                for w, n in (("metadata", 2000000000), ("type", 2000000000), ("version", 2000000000),
                             ("edges", 250000000))}
    expected[attacks.chunk_bomb(str(tmp_path))] = "786432 chunks of 4 bytes"
    expected[attacks.gzip_bomb(str(tmp_path))] = (r"more than 1073741824 bytes of data \(reached at "
                                                  r"'/node/nodes/fc/weight': 2139095040 bytes\)")
    assert all(os.path.getsize(p) < 4 * 2**20 for p in expected)
    rows = _measured_loads(list(expected))
    for path, pattern in expected.items():
        outcome, peak = rows[path]["outcome"], rows[path]["peak"]
        assert outcome.startswith(f"NIRError: {path}") and re.search(pattern, outcome), outcome
        assert peak < 32 * 2**20, f"{path}: refusing took {peak / 2**20:.0f} MiB"


def test_a_file_within_the_budget_reads_in_chunked_slabs(tmp_path):
    """A weight in 8,192 chunks of 1 KiB (more than one read's worth) loads exactly."""
    path = tmp_path / "slabs.nir"
    attacks.write_plain(attacks.dense_graph(2**13, 256), path)
    weight = np.random.default_rng(0).standard_normal((256, 2**13)).astype(np.float32)
    with h5py.File(path, "a") as f:
        del f["node/nodes/fc/weight"]
        f.create_dataset("node/nodes/fc/weight", data=weight, chunks=(16, 16), compression="gzip")
    attacks.forge(path)
    assert np.array_equal(_quiet_load(path).nodes["fc"].weight, weight)


@pytest.mark.parametrize("change, match", [
    ("filter", "filter"), ("big chunk", "declares chunks of"),
    ("budget", r"more than 1048576 bytes of data \(reached at '/node/nodes/fc/weight'")])
def test_storage_beyond_the_rules_is_refused_by_name(tmp_path, change, match):
    path = tmp_path / "f.nir"
    n = 1024 if change == "budget" else 64
    attacks.write_plain(attacks.dense_graph(n, n), path, compression="gzip")
    kw = {}
    with h5py.File(path, "a") as f:
        del f["node/nodes/fc/weight"]
        if change == "filter":  # scaleoffset passes; an unregistered plugin id does not
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk((64, 64))
            dcpl.set_filter(307, h5py.h5z.FLAG_OPTIONAL, ())  # bzip2's registered id, not loaded
            space = h5py.h5s.create_simple((64, 64))
            h5py.h5d.create(f["node/nodes/fc"].id, b"weight", h5py.h5t.IEEE_F32LE, space, dcpl=dcpl)
        elif change == "big chunk":
            f.create_dataset("node/nodes/fc/weight", shape=(64, 64), maxshape=(None, 64),
                             chunks=(2**16, 64), dtype=np.float32)
        else:  # 4 MiB of values in a file of a few KiB
            f.create_dataset("node/nodes/fc/weight", data=np.ones((n, n), np.float32),
                             compression="gzip")
            kw = {"max_bytes": 2**20}
    attacks.forge(path, {"/node/nodes/fc/weight": np.zeros((64, 64), np.float32)} if change != "budget"
                  else None)
    with pytest.raises(NIRError, match=match):
        load_nir(path, **kw)


@pytest.mark.parametrize("extra", [("n1_fire", "n2"), ("n1_fire", "n1"), ("n2_fire", "n1")])
def test_an_edge_from_a_neuron_into_an_integrator_is_refused_by_name(tmp_path, extra):
    """The reader used to drop every hidden-node input of an integrator, not only its own
    reset edge; the graph ran as if the edge were not there."""
    from snnconv.nir.reader import parse

    graph = attacks.two_neuron_graph(extra)
    with pytest.raises(NIRError, match=f"edge '{extra[0]}' -> '{extra[1]}'"):
        parse(graph)
    path = tmp_path / "extra.nir"
    attacks.write_plain(graph, path)
    with pytest.raises(NIRError, match=f"{path}: edge '{extra[0]}' -> '{extra[1]}'"):
        load_nir(path)


def test_a_reset_scale_feeding_another_integrator_is_refused():
    from snnconv.nir.reader import parse

    with pytest.raises(NIRError, match="node 'n2': no single reset Scale"):
        parse(attacks.two_neuron_graph(("n2_reset", "n1")))


def test_the_same_spikes_routed_through_a_node_keep_their_meaning():
    """The refused edge's legitimate form: n1's spikes reach n2 through a sum node."""
    from snnconv.nir.format import OP_KEY, SUM_OP
    from snnconv.nir.reader import parse

    graph = attacks.two_neuron_graph(("n1_fire", "route"))
    graph.nodes["route"] = nir.Scale(np.ones(4, np.float32), metadata={OP_KEY: SUM_OP})
    graph.edges.append(("route", "n2"))
    assert parse(graph).op("n2").inputs == ("fc2", "route")
    assert parse(graph).op("route").inputs == ("n1",)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_T_is_refused_naming_the_file(tmp_path, value, capsys):
    """T = NaN used to raise ValueError (inspect exit 2 without the file's name), T = inf
    OverflowError (inspect exit 3)."""
    from snnconv.cli import main

    path = attacks.metadata_T(str(tmp_path), value)
    with pytest.raises(NIRError, match=f"{re.escape(path)}: graph metadata T=.*not a positive integer"):
        load_nir(path)
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and path in err[0] and "T=" in err[0]


def test_metadata_nested_thousands_deep_is_refused(tmp_path):
    path = attacks.deep_metadata(str(tmp_path), 5000)
    with pytest.raises(NIRError, match="nests metadata deeper than 3 levels"):
        load_nir(path)


# --- /version under the digest --------------------------------------------------------------

def _set_version(path, version: str) -> None:
    with h5py.File(path, "a") as f:
        del f["version"]
        f.create_dataset("version", data=version, dtype=h5py.string_dtype())


@pytest.mark.parametrize("version", ["1.0.5", "1.0.9", "2.0"])
def test_a_changed_version_under_an_unchanged_digest_is_refused(tmp_path, version):
    """/version decides how plain IF nodes read (before 1.0.6: by subtraction)."""
    path = _saved(tmp_path, tiny_graph("zero"))
    _set_version(path, version)
    with pytest.raises(NIRError, match=f"'/version' says nir '{version}'.*{VERSION_KEY}.*digest"):
        load_nir(path)


def test_files_of_earlier_snnconv_versions_still_load_and_their_version_is_checked(tmp_path):
    """Earlier snnconv wrote a digest without the version record, and /version 1.0.8 only."""
    path = tmp_path / "old.nir"
    attacks.write_plain(tiny_graph("zero"), path)
    attacks.forge(path, record_version=False)  # what save_nir wrote before this change
    with h5py.File(path) as f:
        assert VERSION_KEY not in f["node/metadata"] and f["version"][()] == b"1.0.8"
    assert same_graph(_quiet_load(path), load_nir(_saved(tmp_path, tiny_graph("zero"))))
    _set_version(path, "1.0.5")
    with pytest.raises(NIRError, match="'/version' says nir '1.0.5'.*1.0.8 only"):
        load_nir(path)


def test_a_removed_version_record_breaks_the_digest(tmp_path):
    path = _saved(tmp_path, tiny_graph("zero"))
    with h5py.File(path, "a") as f:
        del f[f"node/metadata/{VERSION_KEY}"]
    _set_version(path, "1.0.5")
    with pytest.raises(NIRError, match="changed after it was written"):
        load_nir(path)


# --- only regular files ---------------------------------------------------------------------

def _run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snnconv.cli", *argv], env=_ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_snnconv_run_refuses_a_fifo_as_the_prefix_file_without_waiting(tmp_path):
    """A NIR file naming fifo.pt as its prefix, a FIFO there: snnconv run waited
    forever (load_prefix checked the size, not the kind of file)."""
    os.mkfifo(tmp_path / "fifo.pt")
    path = attacks.prefix_graph_file(str(tmp_path), "fifo.pt")
    proc = _run_cli("run", path, "--backend", "cpu", "--data", "digits", timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert "fifo.pt is a FIFO (named pipe), not a regular file" in proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "socket"])
def test_only_regular_files_are_read(tmp_path, kind):
    import socket

    from snnconv.snn.prefixfile import load_prefix

    target = tmp_path / "x.pt"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        os.symlink("/dev/zero", target)
    elif kind == "folder":
        target.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
    what = {"fifo": "a FIFO", "device": "a character device", "folder": "a folder",
            "socket": "a socket"}[kind]
    graph = load_nir(attacks.prefix_graph_file(str(tmp_path), "x.pt"))
    with pytest.raises(NIRError, match=f"x.pt is {what}.*not a regular file"):
        load_prefix(graph, tmp_path / "prefixed.nir")
    with pytest.raises(NIRError, match=f"x.pt is {what}.*not a regular file"):
        load_nir(target)


def test_snnconv_export_refuses_a_fifo_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "net.pt")
    proc = _run_cli("export", str(tmp_path / "net.pt"), str(tmp_path / "out.nir"))
    assert proc.returncode == 2 and "net.pt is a FIFO" in proc.stderr, proc.stderr


def test_open_regular_bounds_the_size(tmp_path):
    from snnconv.io.files import open_regular

    path = tmp_path / "big.bin"
    with open(path, "wb") as fh:
        fh.truncate(2**20 + 1)  # sparse: no disk used
    with pytest.raises(NIRError, match=r"1048577 bytes, more than the 1048576 bytes"):
        open_regular(path, 2**20, error=NIRError)
    with open_regular(path, 2**21) as fh:
        assert len(fh.read()) == 2**20 + 1
