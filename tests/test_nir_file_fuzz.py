"""Mutated NIR files: each one loads equal to the original, loads with the documented warning,
or is refused with NIRError; never a changed graph without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections import Counter

import h5py
import numpy as np
from _nirfiles import same_graph, tiny_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from snnconv.errors import NIRError
from snnconv.io.digest import UnverifiedFileWarning
from snnconv.snn.nir_io import load_nir, save_nir

_STRUCTURAL = ("swap", "remove", "add dataset", "add group", "soft link", "external link",
               "external storage", "virtual")
MUTATIONS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0, exclude_max=True), st.just(0)),
    st.tuples(st.just("flip"), st.floats(0.0, 1.0, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.sampled_from(_STRUCTURAL), st.floats(0.0, 1.0, exclude_max=True), st.just(0)),
)


def _pick(items: list, where: float):
    return items[int(where * len(items))]


def mutate(path: str, other: str, kind: str, where: float, value: int) -> None:
    """Apply one mutation to the file at ``path`` (``other``: a second HDF5 file it may point at)."""
    if kind in ("truncate", "flip"):
        data = bytearray(open(path, "rb").read())
        pos = int(where * len(data))
        if kind == "truncate":
            del data[pos:]
        else:
            data[pos] ^= value
        with open(path, "wb") as fh:
            fh.write(bytes(data))
        return
    with h5py.File(path, "a") as f:
        paths: list[str] = []
        f.visit(paths.append)
        datasets = [p for p in paths if isinstance(f[p], h5py.Dataset)]
        groups = ["/"] + [p for p in paths if isinstance(f[p], h5py.Group)]
        arrays = [p for p in datasets if f[p].dtype.kind == "f" and f[p].size > 1]
        if kind == "swap":  # the same values under another shape
            p = _pick(arrays, where)
            data = f[p][()]
            del f[p]
            f[p] = data.T.copy() if data.ndim > 1 else data.reshape(1, -1)
        elif kind == "remove":
            del f[_pick(paths, where)]
        elif kind in ("add dataset", "add group", "soft link", "external link"):
            g = f[_pick(groups, where)]
            if kind == "add dataset":
                g["extra"] = np.zeros(8, np.float32)
            elif kind == "add group":
                g.create_group("extra")
            elif kind == "soft link":
                g["extra"] = h5py.SoftLink("/" + _pick(datasets, where))
            else:
                g["extra"] = h5py.ExternalLink(other, "/w")
        else:  # a weight whose bytes come from another file
            p = _pick(arrays, where)
            shape, dtype = f[p].shape, f[p].dtype
            del f[p]
            if kind == "virtual":
                with h5py.File(other, "a") as src:
                    name = f"v{len(src)}"
                    src[name] = np.full(shape, 7.0, dtype)
                layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                layout[...] = h5py.VirtualSource(other, name, shape=shape)
                f.create_virtual_dataset(p, layout)
            else:
                raw = other + ".raw"
                with open(raw, "wb") as fh:
                    fh.write(np.full(shape, 7.0, dtype).tobytes())
                f.create_dataset(p, shape=shape, dtype=dtype, external=[(raw, 0, h5py.h5f.UNLIMITED)])


def outcome(path: str, original) -> str:
    """"equal", "warned" or "refused"; AssertionError for a changed graph loaded silently."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            graph = load_nir(path)
        except NIRError:
            return "refused"
    if same_graph(graph, original):
        return "equal"
    assert any(issubclass(w.category, UnverifiedFileWarning) for w in caught), \
        "a changed graph loaded without a warning"
    return "warned"


def test_mutated_files_load_equal_warn_or_are_refused():
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, "other.h5")
        with h5py.File(other, "w") as f:
            f["w"] = np.full(64, 7.0, np.float32)
        files = {}
        for reset in ("subtract", "zero"):
            files[reset] = os.path.join(tmp, f"{reset}.nir")
            save_nir(tiny_graph(reset), files[reset])
        originals = {reset: load_nir(path) for reset, path in files.items()}
        pristine = {reset: open(path, "rb").read() for reset, path in files.items()}

        @settings(max_examples=100, deadline=None, database=None, derandomize=True)
        @given(reset=st.sampled_from(["subtract", "zero"]), mutation=MUTATIONS)
        def check(reset, mutation):
            path = os.path.join(tmp, "mutated.nir")
            with open(path, "wb") as fh:
                fh.write(pristine[reset])
            mutate(path, other, *mutation)
            counts[outcome(path, originals[reset])] += 1

        check()
    print(f"mutated files: {sum(counts.values())}, {dict(counts)}")
    assert counts["refused"] > 0 and counts["equal"] > 0


# --- one child process per reader, capped in memory and time ------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# reader -> the fewest cases it runs
_READERS = {"nirfile": 60, "nirgraph": 150, "prefix": 30, "network": 120, "checkpoint": 60}


def test_each_reader_gives_an_snnconv_error_or_a_correct_load_within_the_budget(tmp_path):
    """Per reader, one child (tests/_fuzz_readers.py) capped at its size after imports + 2 GiB
    of address space and 20 CPU seconds per case runs all of its cases: mutants of small valid files and
    graphs, the known hostile files (digests forged) and every kind of path. Each case ends in
    a snnconv error or a correct load, runs no code (a payload would create a marker file), and
    adds less than the read budget to the child's resident memory."""
    from snnconv.io.files import MAX_FILE_BYTES

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.path.join(_ROOT, "backends")])}
    children = {}
    for reader in _READERS:
        folder = tmp_path / reader
        folder.mkdir()
        children[reader] = subprocess.Popen(
            [sys.executable, os.path.join(_ROOT, "tests", "_fuzz_readers.py"), reader, str(folder)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for reader, child in children.items():
        out, err = child.communicate(timeout=3600)  # a hang guard only (cases are bounded in CPU time)
        assert child.returncode == 0, err[-3000:]
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(rows) >= _READERS[reader], err[-3000:]
        for row in rows:
            assert not row["outcome"].startswith("RAW"), f"{reader}: {row}"
            assert not row["code_ran"], f"{reader}: {row}"
            assert row["peak"] < MAX_FILE_BYTES, f"{reader}: {row}"
        counts = Counter(row["outcome"] for row in rows)
        assert counts["loaded"] > 0 and counts["NIRError" if reader.startswith(("nir", "prefix"))
                                               else "CheckpointError"] > 0, counts
        print(f"{reader}: {len(rows)} cases, {dict(counts)}, largest peak "
              f"{max(r['peak'] for r in rows) / 2**20:.1f} MiB")
