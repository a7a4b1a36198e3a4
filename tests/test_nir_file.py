"""The NIR file reader and writer: only the file itself is read, declared sizes are checked
before any data, snnconv's files carry a digest, and T is bounded."""

from __future__ import annotations

import tracemalloc
import warnings

import h5py
import nir
import numpy as np
import pytest

from snnconv.digest import UnverifiedFileWarning
from snnconv.errors import NIRError
from snnconv.nir_io import load_nir, save_nir
from snnconv.config import MAX_T
from snnconv.nirfile import DIGEST_KEY, VERSION_KEY
from _nirfiles import chain_graph, same_graph, tiny_graph


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
