"""NIR files: an atomic writer that records a digest, and a strict reader of untrusted files.

The reader walks the HDF5 layout that ``nir.write`` (nir 1.0.8) produces itself, with h5py,
and builds the ``nir.NIRGraph`` from what it read; it never calls ``nir.read``. In order:

0. Only a regular file of at most ``max_bytes`` (the read budget,
   :data:`snnconv.io.files.MAX_FILE_BYTES`, 1 GiB): the path is opened with
   :func:`snnconv.io.files.open_regular` (a FIFO, device, socket or folder is refused without
   blocking) and HDF5 reads that open file.
1. Only the file itself: soft links, external links, external raw storage, virtual datasets
   and committed datatypes are refused by name (each could make another file's bytes the
   graph's).
2. Only NIR's layout: ``/version``, ``/node`` with ``type``, ``nodes``, ``edges`` and
   ``metadata``, and per node exactly the fields its NIR type has (:data:`FIELDS`); any other
   group or dataset is refused by name, so an unused dataset is never read.
3. Declared sizes before any data: every field's dtype (numbers or text) and rank, the shapes
   a node's fields must share (a bias as long as its weight's rows, an IF's three arrays
   alike), the number of nodes and edges, the total number of values and, in bytes, what
   reading would allocate (dtype size times shape: a fixed-length string counts its declared
   length, a compressed dataset its inflated size) against ``max_bytes``; the storage: only
   HDF5's own filters, chunks of at least 1 KiB (HDF5 spends about 4 KiB of memory per chunk
   read) and at most 2**17 of them, no chunk larger than its dataset, stored sizes that fit in
   the file. Strings hold at most 64 KiB each (a fixed-length one is refused on its declared
   length; a variable-length one is read one at a time and checked). Chunked datasets are read
   4,096 chunks at a time. The caps are overridable per call.
4. The graph metadata's ``T`` is a finite positive integer, at most ``max_T`` (default
   :data:`snnconv.vocabulary.MAX_T`, the bound ``convert`` uses).
5. Files written by :func:`save_nir` carry ``metadata["snnconv_digest"]``, the
   :func:`snnconv.io.digest.content_digest` of everything else read from the file, and
   ``metadata["snnconv_nir_version"]``, the ``/version`` it was written with (so the digest
   covers ``/version``, which decides how plain ``IF`` nodes are read): a file whose content
   does not match its digest, or whose ``/version`` differs from the recorded one, is refused.
   Files of earlier snnconv versions have a digest but no recorded version; they wrote
   ``/version`` 1.0.8 only (:data:`UNRECORDED_VERSIONS`), and any other is refused. A file
   without a digest that carries snnconv's encoding (producer, format or neuron markers) loads
   with :class:`snnconv.io.digest.UnverifiedFileWarning`; other tools' files (no digest, no
   markers) are checked for structure only.
6. The graph passes :func:`snnconv.nir.reader.parse`.

The digest covers the values, so it can only be checked once they are read: the checks of
step 3 bound what that reading allocates, and the digest is checked before nir builds its nodes
or the graph is parsed. A load's peak memory is about 2.5 times the bytes the file declares
(the values read, their digest, the float32 arrays the parser makes): 1.3 GiB for a graph of
VGG-16's 138.3 M float32 parameters, measured (``python -m benchmarks interop nir_file_attacks --admit``).
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import nir
import numpy as np

from snnconv.errors import ConfigError, NIRError, ResourceError
from snnconv.io.atomic import atomic_write_bytes
from snnconv.io.digest import UnverifiedFileWarning, content_digest
from snnconv.io.files import MAX_FILE_BYTES, open_regular
from snnconv.nir.format import (
    MODULE_KEY,
    NEURON_KEY,
    OP_KEY,
    PRODUCER,
    SOURCE_VERSION_KEY,
    legacy_if_reason,
    predates_v_reset,
)
from snnconv.vocabulary import MAX_T

__all__ = ["save_nir", "load_nir", "read_nir_tree", "FIELDS", "DIGEST_KEY", "VERSION_KEY",
           "UNRECORDED_VERSIONS", "MAX_NODES", "MAX_EDGES", "MAX_VALUES", "MAX_FILE_BYTES"]

#: graph metadata key of the content digest written by :func:`save_nir`
DIGEST_KEY = "snnconv_digest"
#: graph metadata key of the ``/version`` the file was written with, under the digest
VERSION_KEY = "snnconv_nir_version"
#: the ``/version`` of every file snnconv wrote with a digest before :data:`VERSION_KEY` (nir has
#: been pinned to 1.0.8 since snnconv's first release)
UNRECORDED_VERSIONS = ("1.0.8",)
#: default caps of :func:`load_nir` (a CIFAR-10 ResNet-18 file: 81 nodes, 105 edges, 13.0 M values);
#: the bytes are :data:`snnconv.io.files.MAX_FILE_BYTES`, the read budget of every snnconv file
MAX_NODES = 4096
MAX_EDGES = 16384
MAX_VALUES = 2**28
_MAX_RANK = 8  # dimensions of one array
_MAX_META = 256  # entries of one metadata group
_MAX_META_DEPTH = 3
_MAX_TEXT = 2**16  # bytes of one string (a type, a version, a node name, a metadata text)
# chunked storage: HDF5 holds about 4 KiB per chunk of one read until the read ends, so reads
# cover at most _CHUNKS_PER_READ chunks (16 MiB); h5py's own chunks are 4 KiB to 1 MiB (a VGG-16
# written by nir.write with gzip: 7,729 chunks of 6.9 KiB to 98 KiB)
_MIN_CHUNK_BYTES = 1024
_MAX_CHUNKS = 2**17
_CHUNKS_PER_READ = 4096
# HDF5's own filters (no plugin): deflate, shuffle, fletcher32, szip, nbit, scaleoffset, and lzf
_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset",
            32000: "lzf"}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class Field:
    """One dataset of a NIR node: ``text`` (a string) or numbers of rank ``ndim`` (a range)."""

    required: bool = True
    text: bool | None = False  # None: text or numbers
    ndim: tuple[int, int] = (0, _MAX_RANK)
    size: int | None = None  # at most this many values


_INTS = Field(ndim=(0, 1), size=2)
_SHAPE = Field(ndim=(1, 1), size=_MAX_RANK)
_ARRAY = Field()
_META = Field(text=None, size=2**16)  # one metadata entry: a string, a number or a short list

#: the fields of every NIR type the reader accepts (nir 1.0.8's ``to_dict`` names)
FIELDS: dict[str, dict[str, Field]] = {
    "Input": {"shape": _SHAPE},
    "Output": {"shape": _SHAPE},
    "Conv1d": {"input_shape": Field(required=False, ndim=(0, 1), size=1),
               "weight": Field(ndim=(3, 3)), "bias": Field(ndim=(1, 1)),
               "stride": _INTS, "padding": Field(ndim=(0, 1), size=1, text=None),
               "dilation": _INTS, "groups": Field(ndim=(0, 0))},
    "Conv2d": {"input_shape": Field(required=False, ndim=(0, 1), size=2),
               "weight": Field(ndim=(4, 4)), "bias": Field(ndim=(1, 1)),
               "stride": _INTS, "padding": Field(ndim=(0, 1), size=2, text=None),
               "dilation": _INTS, "groups": Field(ndim=(0, 0))},
    "Affine": {"weight": Field(ndim=(2, 2)), "bias": Field(ndim=(1, 1))},
    "Linear": {"weight": Field(ndim=(2, 2))},
    "AvgPool2d": {"kernel_size": _INTS, "stride": _INTS, "padding": _INTS},
    "SumPool2d": {"kernel_size": _INTS, "stride": _INTS, "padding": _INTS},
    "Flatten": {"start_dim": Field(ndim=(0, 0)), "end_dim": Field(ndim=(0, 0)),
                "input_type": Field(required=False, ndim=(1, 1), size=_MAX_RANK)},
    "Scale": {"scale": _ARRAY},
    "I": {"r": _ARRAY},
    "IF": {"r": _ARRAY, "v_threshold": _ARRAY, "v_reset": Field(required=False)},
    "Threshold": {"threshold": _ARRAY},
    "LIF": {"tau": _ARRAY, "r": _ARRAY, "v_leak": _ARRAY, "v_threshold": _ARRAY,
            "v_reset": Field(required=False)},
    "CubaLIF": {"tau_syn": _ARRAY, "tau_mem": _ARRAY, "r": _ARRAY, "v_leak": _ARRAY,
                "v_threshold": _ARRAY, "v_reset": Field(required=False), "w_in": _ARRAY},
    "LI": {"tau": _ARRAY, "r": _ARRAY, "v_leak": _ARRAY},
}
# within a node: (field, the field whose shape it must have); (bias, weight with one row per bias)
_SAME_SHAPE = {"IF": (("v_threshold", "r"), ("v_reset", "r")),
               "LIF": (("tau", "r"), ("v_leak", "r"), ("v_threshold", "r"), ("v_reset", "r")),
               "CubaLIF": tuple((k, "r") for k in ("tau_syn", "tau_mem", "v_leak", "v_threshold",
                                                    "v_reset")),  # w_in may be one number
               "LI": (("tau", "r"), ("v_leak", "r"))}
_ROWS = {"Affine": ("bias", "weight"), "Conv1d": ("bias", "weight"), "Conv2d": ("bias", "weight")}


class _Budget:
    """Counts what the file declares against the caps, before any value is read (NIRError past
    one): values, bytes (:data:`snnconv.io.files.MAX_FILE_BYTES`), chunks, stored bytes."""

    def __init__(self, where: str, max_nodes: float, max_edges: float, max_values: float,
                 max_bytes: float = MAX_FILE_BYTES, file_bytes: float = float("inf")):
        self.where, self.values, self.bytes, self.chunks, self.stored = where, 0, 0, 0, 0
        self.max_nodes, self.max_edges, self.max_values = max_nodes, max_edges, max_values
        self.max_bytes, self.file_bytes = max_bytes, file_bytes
        self.text = 0  # bytes of variable-length text read so far

    def add(self, size: int, name: str, nbytes: int = 0, chunks: int = 0, stored: int = 0) -> None:
        self.values += size
        self.bytes += nbytes
        self.chunks += chunks
        self.stored += stored
        if self.values > self.max_values:
            raise NIRError(f"{self.where}: the file declares more than {self.max_values} values "
                           f"(reached at '{name}'); nothing was read. If the network is that "
                           "large, pass load_nir(..., max_values=N)")
        if self.bytes > self.max_bytes:
            raise NIRError(f"{self.where}: the file declares more than {self.max_bytes} bytes of data "
                           f"(reached at '{name}': {nbytes} bytes), above the read budget; nothing "
                           "was read. If the network is that large, pass load_nir(..., max_bytes=N)")
        if self.chunks > _MAX_CHUNKS:
            raise NIRError(f"{self.where}: the file's datasets are stored in more than {_MAX_CHUNKS} "
                           f"chunks (reached at '{name}'); HDF5 spends memory and time per chunk, and "
                           "NIR's writer stores a whole network in far fewer. Nothing was read")
        if self.stored > self.file_bytes:
            raise NIRError(f"{self.where}: its datasets claim {self.stored} bytes of storage (reached "
                           f"at '{name}'), more than the {self.file_bytes} bytes the file holds; it is "
                           "damaged or crafted")


def _refuse_foreign(where: str, group: Any, name: str) -> Any:
    """The object ``group[name]`` when it is stored in this file; NIRError naming it otherwise."""
    import h5py

    full = f"{group.name.rstrip('/')}/{name}"
    link = group.get(name, getlink=True)
    if isinstance(link, h5py.SoftLink):
        raise NIRError(f"{where}: '{full}' is a soft link (to '{link.path}'); snnconv reads only "
                       "datasets stored in place")
    if isinstance(link, h5py.ExternalLink):
        raise NIRError(f"{where}: '{full}' is an external link (to '{link.path}' in file "
                       f"'{link.filename}'); snnconv reads only the file itself")
    if not isinstance(link, h5py.HardLink):
        raise NIRError(f"{where}: '{full}' is a {type(link).__name__}; snnconv reads only "
                       "datasets stored in place")
    obj = group[name]
    if isinstance(obj, h5py.Dataset):
        if obj.is_virtual:
            raise NIRError(f"{where}: '{full}' is a virtual dataset (it maps other files' data); "
                           "snnconv reads only the file itself")
        if obj.external:
            files = sorted({str(e[0]) for e in obj.external})
            raise NIRError(f"{where}: '{full}' keeps its data in external raw storage "
                           f"({', '.join(files)}); snnconv reads only the file itself")
    elif not isinstance(obj, h5py.Group):
        raise NIRError(f"{where}: '{full}' is a {type(obj).__name__}, not a group or dataset")
    return obj


def _children(where: str, group: Any, limit: float, hint: str = "") -> list[tuple[str, Any]]:
    """The entries of ``group`` (each checked by :func:`_refuse_foreign`), at most ``limit``."""
    import h5py

    if not isinstance(group, h5py.Group):
        raise NIRError(f"{where}: '{group.name}' is a dataset; NIR's layout has a group there")
    if len(group) > limit:
        raise NIRError(f"{where}: '{group.name}' has {len(group)} entries, more than {limit:g}; "
                       f"nothing was read{hint}")
    return [(name, _refuse_foreign(where, group, name)) for name in group]


def _is_text(ds: Any) -> bool:
    import h5py

    return h5py.check_string_dtype(ds.dtype) is not None


def _declared_bytes(ds: Any) -> int:
    """What reading ``ds`` allocates: its dtype's size (a fixed-length string at its declared
    length) times its number of elements."""
    return int(ds.dtype.itemsize) * int(np.prod(ds.shape or (), dtype=np.int64))


def _check_storage(where: str, ds: Any, nbytes: int) -> tuple[int, int]:
    """(chunks, stored bytes) of ``ds`` after its layout passed: only HDF5's own filters, chunks of
    at least :data:`_MIN_CHUNK_BYTES` (unless the dataset is one chunk) and no larger than the
    dataset (or 1 MiB). Nothing is read."""
    stored = int(ds.id.get_storage_size())
    if ds.chunks is None:
        return 0, stored
    plist = ds.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, _flags, _values, name = plist.get_filter(i)
        if code not in _FILTERS:
            label = name.decode("utf8", "replace") if isinstance(name, bytes) else str(name)
            raise NIRError(f"{where}: '{ds.name}' is stored through filter {code} ({label!r}); "
                           f"snnconv reads {', '.join(_FILTERS.values())} only")
    chunk_bytes = int(ds.dtype.itemsize) * int(np.prod(ds.chunks, dtype=np.int64))
    count = int(np.prod([-(-n // c) for n, c in zip(ds.shape, ds.chunks)], dtype=np.int64))
    if count > 1 and chunk_bytes < _MIN_CHUNK_BYTES:
        raise NIRError(f"{where}: '{ds.name}' is stored in {count} chunks of {chunk_bytes} bytes; "
                       f"snnconv reads chunks of at least {_MIN_CHUNK_BYTES} bytes (HDF5 spends about "
                       "4 KiB of memory per chunk read; h5py's own chunks are 4 KiB to 1 MiB)")
    if chunk_bytes > max(nbytes, 2**20):
        raise NIRError(f"{where}: '{ds.name}' declares chunks of {chunk_bytes} bytes for {nbytes} "
                       "bytes of data; reading one would allocate the whole chunk")
    return count, stored


def _check_dataset(where: str, ds: Any, field: Field, budget: _Budget) -> None:
    import h5py

    if not isinstance(ds, h5py.Dataset):
        raise NIRError(f"{where}: '{ds.name}' is a group; NIR writes a dataset there")
    if ds.shape is None:
        raise NIRError(f"{where}: '{ds.name}' has no shape (an empty dataspace); NIR writes values")
    text = _is_text(ds)
    if field.text is not None and text != field.text:
        raise NIRError(f"{where}: '{ds.name}' holds {'text' if text else ds.dtype}, NIR writes "
                       f"{'text' if field.text else 'numbers'} there")
    nbytes = _declared_bytes(ds)
    if text:
        if ds.shape != ():
            raise NIRError(f"{where}: '{ds.name}' is text of shape {ds.shape}; NIR writes one string")
        if ds.dtype.itemsize > _MAX_TEXT and ds.dtype.kind == "S":
            raise NIRError(f"{where}: '{ds.name}' is a fixed-length string of {ds.dtype.itemsize} "
                           f"bytes; snnconv reads strings of at most {_MAX_TEXT} bytes. Nothing was "
                           "read")
        budget.add(0, ds.name, nbytes, *_check_storage(where, ds, nbytes))
        return
    if ds.dtype.kind not in "fiub" or ds.dtype.subdtype is not None:
        raise NIRError(f"{where}: '{ds.name}' has dtype {ds.dtype}; NIR writes numbers there")
    lo, hi = field.ndim
    if not lo <= len(ds.shape) <= hi:
        raise NIRError(f"{where}: '{ds.name}' has shape {ds.shape}; a rank from {lo} to {hi} "
                       "is expected")
    size = int(np.prod(ds.shape, dtype=np.int64))
    if field.size is not None and size > field.size:
        raise NIRError(f"{where}: '{ds.name}' has {size} values, at most {field.size} expected")
    budget.add(size, ds.name, nbytes, *_check_storage(where, ds, nbytes))


def _check_metadata(where: str, group: Any, budget: _Budget, depth: int = 0) -> None:
    import h5py

    if depth >= _MAX_META_DEPTH:
        raise NIRError(f"{where}: '{group.name}' nests metadata deeper than {_MAX_META_DEPTH} levels")
    for _name, obj in _children(where, group, _MAX_META):
        if isinstance(obj, h5py.Group):
            _check_metadata(where, obj, budget, depth + 1)
        else:
            _check_dataset(where, obj, _META, budget)


def _check_node(where: str, name: str, group: Any, budget: _Budget) -> None:
    import h5py

    if not isinstance(group, h5py.Group):
        raise NIRError(f"{where}: node '{name}' is a dataset; NIR writes a group per node")
    entries = dict(_children(where, group, len(max(FIELDS.values(), key=len)) + 2))
    if "type" not in entries:
        raise NIRError(f"{where}: node '{name}' has no type")
    kind = _text(where, entries["type"])
    fields = FIELDS.get(kind)
    if fields is None:
        raise NIRError(f"{where}: node '{name}' has type {kind!r}; snnconv reads {sorted(FIELDS)}")
    for key in entries:
        if key not in fields and key not in ("type", "metadata"):
            raise NIRError(f"{where}: node '{name}' ({kind}) has an unexpected entry '{key}'; NIR's "
                           f"{kind} has {sorted(fields)} (and type, metadata)")
    for key, field in fields.items():
        if key not in entries:
            if field.required:
                raise NIRError(f"{where}: node '{name}' ({kind}) lacks its '{key}'")
            continue
        _check_dataset(where, entries[key], field, budget)
    for key, ref in _SAME_SHAPE.get(kind, ()):
        if key in entries and entries[key].shape != entries[ref].shape:
            raise NIRError(f"{where}: node '{name}' ({kind}): '{key}' has shape {entries[key].shape}, "
                           f"'{ref}' {entries[ref].shape}; they must agree")
    if kind in _ROWS:
        key, ref = _ROWS[kind]
        if entries[key].shape != entries[ref].shape[:1]:
            raise NIRError(f"{where}: node '{name}' ({kind}): '{key}' has shape {entries[key].shape} "
                           f"for a '{ref}' of shape {entries[ref].shape}; one value per output is "
                           "expected")
    if "metadata" in entries:
        _check_metadata(where, entries["metadata"], budget)


def _text(where: str, ds: Any) -> str:
    """The one string ``ds`` holds (at most :data:`_MAX_TEXT` bytes, checked before reading a
    fixed-length string and after reading a variable-length one)."""
    import h5py

    if not isinstance(ds, h5py.Dataset) or not _is_text(ds) or ds.shape != ():
        raise NIRError(f"{where}: '{ds.name}' is not one string")
    if ds.dtype.itemsize > _MAX_TEXT:
        raise NIRError(f"{where}: '{ds.name}' is a fixed-length string of {ds.dtype.itemsize} bytes; "
                       f"snnconv reads strings of at most {_MAX_TEXT} bytes. Nothing was read")
    value = ds[()]
    if len(value) > _MAX_TEXT:
        raise NIRError(f"{where}: '{ds.name}' holds a string of {len(value)} bytes; snnconv reads "
                       f"strings of at most {_MAX_TEXT} bytes")
    return value.decode("utf8", "replace") if isinstance(value, bytes) else str(value)


def _layout(where: str, f: Any, budget: _Budget) -> None:
    """Check the whole layout on declared shapes; reads only the type strings."""
    import h5py

    root = dict(_children(where, f, 2))
    if set(root) != {"node", "version"}:
        raise NIRError(f"{where} is HDF5 but not a NIR file: it holds {sorted(root)}, a NIR file "
                       "holds 'node' and 'version'")
    _text(where, root["version"])
    graph = dict(_children(where, root["node"], 4))
    extra = set(graph) - {"type", "nodes", "edges", "metadata"}
    if extra or not {"type", "nodes", "edges"} <= set(graph):
        raise NIRError(f"{where}: '/node' holds {sorted(graph)}; a NIRGraph holds type, nodes, "
                       "edges and metadata")
    kind = _text(where, graph["type"])
    if kind != "NIRGraph":
        raise NIRError(f"{where}: the root node is a {kind!r}, not a NIRGraph")
    hint = ". If the network is that large, pass load_nir(..., max_nodes=N)"
    for name, node in _children(where, graph["nodes"], budget.max_nodes, hint):
        _check_node(where, name, node, budget)
    edges = graph["edges"]
    if not isinstance(edges, h5py.Dataset):
        raise NIRError(f"{where}: '/node/edges' is not a dataset")
    shape: tuple[int, ...] = edges.shape or ()
    if shape not in ((0,),) and not (len(shape) == 2 and shape[1] == 2 and _is_text(edges)):
        raise NIRError(f"{where}: '/node/edges' has shape {edges.shape} and dtype {edges.dtype}; "
                       "NIR writes (source, target) names, shape (E, 2)")
    if shape[0] > budget.max_edges:
        raise NIRError(f"{where}: the graph has {shape[0]} edges, more than {budget.max_edges:g}; "
                       "nothing was read. If the network is that large, pass "
                       "load_nir(..., max_edges=N)")
    if edges.dtype.itemsize > _MAX_TEXT:
        raise NIRError(f"{where}: '/node/edges' holds fixed-length strings of {edges.dtype.itemsize} "
                       f"bytes; snnconv reads node names of at most {_MAX_TEXT} bytes. Nothing was read")
    nbytes = _declared_bytes(edges)
    budget.add(0, edges.name, nbytes, *_check_storage(where, edges, nbytes))
    if "metadata" in graph:
        _check_metadata(where, graph["metadata"], budget)


def _read_text(where: str, ds: Any, budget: _Budget) -> Any:
    """A checked text dataset, element by element where it holds several strings (a
    variable-length string's bytes are known only once read: one at a time bounds what a
    crafted file can make one read allocate), each at most :data:`_MAX_TEXT` bytes."""
    if ds.shape == ():
        value = ds[()]
        out = value
        values = [value]
    else:
        out = np.empty(ds.shape, dtype=object)
        values = []
        for index in np.ndindex(*ds.shape):
            out[index] = ds[index]
            values.append(out[index])
    for value in values:
        n = len(value) if isinstance(value, (bytes, str)) else 0
        budget.text += n
        if n > _MAX_TEXT or budget.text > budget.max_bytes:
            raise NIRError(f"{where}: '{ds.name}' holds a string of {n} bytes; snnconv reads strings "
                           f"of at most {_MAX_TEXT} bytes, and {budget.max_bytes} bytes of text in all")
    return out


def _read_numbers(ds: Any) -> Any:
    """A checked numeric dataset; a chunked one in slabs of at most :data:`_CHUNKS_PER_READ`
    chunks (HDF5 holds about 4 KiB per chunk of one read until the read ends)."""
    if ds.chunks is None or ds.shape == ():
        return ds[()]
    grid = [-(-n // c) for n, c in zip(ds.shape, ds.chunks)]
    if int(np.prod(grid, dtype=np.int64)) <= _CHUNKS_PER_READ:
        return ds[()]
    out = np.empty(ds.shape, dtype=ds.dtype)
    per_row = int(np.prod(grid[1:], dtype=np.int64))  # chunks of one chunk-row along axis 0
    if per_row <= _CHUNKS_PER_READ:
        step = ds.chunks[0] * max(1, _CHUNKS_PER_READ // max(per_row, 1))
        for start in range(0, ds.shape[0], step):
            ds.read_direct(out, np.s_[start:start + step], np.s_[start:start + step])
        return out
    for sel in ds.iter_chunks():  # one chunk per read
        ds.read_direct(out, sel, sel)
    return out


def _tree(where: str, group: Any, budget: _Budget) -> dict[str, Any]:
    """Read a checked group as nir's ``hdf2dict`` does (bytes scalars decoded), with the bounds
    of :func:`_read_text` and :func:`_read_numbers`."""
    import h5py

    out: dict[str, Any] = {}
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            out[key] = _tree(where, item, budget)
        else:
            value = _read_text(where, item, budget) if _is_text(item) else _read_numbers(item)
            out[key] = value.decode("utf8") if isinstance(value, bytes) else value
    return out


def read_nir_tree(f: Any, where: str, *, max_nodes: float = MAX_NODES, max_edges: float = MAX_EDGES,
                  max_values: float = MAX_VALUES, max_bytes: float = MAX_FILE_BYTES,
                  file_bytes: float = float("inf")) -> dict[str, Any]:
    """The graph of an open ``h5py.File`` as nested dicts (the ``/node`` group), after the
    layout and size checks of the module docstring (steps 1-3). ``where`` names the file in
    errors; ``file_bytes`` is the file's size (its datasets' storage must fit in it)."""
    budget = _Budget(where, max_nodes, max_edges, max_values, max_bytes, file_bytes)
    _layout(where, f, budget)
    return _tree(where, f["node"], budget)


def _has_markers(tree: dict[str, Any]) -> bool:
    meta = tree.get("metadata", {})
    if meta.get("producer") == PRODUCER or "snnconv_format" in meta:
        return True
    keys = (NEURON_KEY, OP_KEY, MODULE_KEY, "snnconv_bias")
    return any(k in node.get("metadata", {}) for node in tree["nodes"].values() for k in keys)


def _pop_meta(tree: dict[str, Any], key: str) -> Any:
    """Remove graph metadata ``key`` from ``tree`` (and a metadata group it leaves empty); return
    its value (None where there is none)."""
    meta = tree.get("metadata", {})
    stored = meta.pop(key, None)
    if "metadata" in tree and not meta:
        del tree["metadata"]
    return stored


def _pop_digest(tree: dict[str, Any]) -> Any:
    """Remove the digest from ``tree`` (and a graph metadata group it leaves empty); return it."""
    return _pop_meta(tree, DIGEST_KEY)


def _verify(where: str, tree: dict[str, Any], version: str) -> None:
    """Check the digest (which covers :data:`VERSION_KEY`, so ``/version`` too) and remove both
    from ``tree``."""
    stored = _pop_digest(tree)
    if stored is not None and (not isinstance(stored, str) or stored != content_digest(tree)):
        raise NIRError(f"{where} was changed after it was written: its content does not match the "
                       f"digest save_nir recorded in it (metadata '{DIGEST_KEY}'). It is damaged or "
                       "edited; export it again")
    recorded = _pop_meta(tree, VERSION_KEY)
    if recorded is not None and recorded != version:
        raise NIRError(f"{where}: '/version' says nir {version!r}, but the file records that it was "
                       f"written by nir {recorded!r} (metadata '{VERSION_KEY}'"
                       f"{', under its digest' if stored is not None else ''}); '/version' decides how "
                       "plain IF nodes are read, so the file was edited. Export it again")
    if stored is None:
        if _has_markers(tree):
            warnings.warn(f"{where} carries snnconv's NIR encoding but no content digest (written by "
                          "an snnconv without digests, or edited): its structure was checked, its "
                          "values could not be verified", UnverifiedFileWarning, stacklevel=3)
        return
    if recorded is None and version not in UNRECORDED_VERSIONS:
        raise NIRError(f"{where}: '/version' says nir {version!r}, but the file's digest comes from an "
                       f"snnconv that wrote its files with nir {' or '.join(UNRECORDED_VERSIONS)} only "
                       f"(and recorded no '{VERSION_KEY}' under the digest): '/version' was edited. "
                       "Export the file again")


def _check_T(where: str, tree: dict[str, Any], max_T: int) -> None:
    T = tree.get("metadata", {}).get("T")
    if T is None:
        return
    value = T.item() if isinstance(T, (np.generic, np.ndarray)) and np.ndim(T) == 0 else T
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value != int(value) or value < 1:
        raise NIRError(f"{where}: graph metadata T={T!r} is not a positive integer")
    if value > max_T:
        raise NIRError(f"{where}: graph metadata T={int(value)} is above the bound of {max_T} time "
                       f"steps; pass load_nir(..., max_T=N) to read it, and a smaller T to run it")


def _check_version(where: str, tree: dict[str, Any], version: str) -> None:
    """Refuse, before nir's node classes fill in ``v_reset = 0``, an IF of a file written by a
    nir older than v_reset (its IF resets by subtraction)."""
    if not predates_v_reset(version):
        return
    for name, node in tree["nodes"].items():
        if node.get("type") == "IF" and NEURON_KEY not in node.get("metadata", {}):
            raise NIRError(f"{where}: {legacy_if_reason(name, version)}")


def _is_hdf5(fh: Any, size: int) -> bool:
    """Whether the open file has HDF5's signature where HDF5 looks for it (offset 0, 512, 1024,
    2048, ...)."""
    offset = 0
    while offset + len(_HDF5_SIGNATURE) <= size:
        fh.seek(offset)
        if fh.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE:
            fh.seek(0)
            return True
        offset = 512 if offset == 0 else offset * 2
    return False


def load_nir(path: str | os.PathLike, *, max_nodes: int = MAX_NODES, max_edges: int = MAX_EDGES,
             max_values: int = MAX_VALUES, max_bytes: int = MAX_FILE_BYTES, max_T: int = MAX_T,
             dt: float = 1.0) -> nir.NIRGraph:
    """Read a NIR file strictly, as untrusted data (HDF5; nothing from the file is executed).

    See the module docstring for what is checked, in which order. Only the datasets the graph's
    nodes have are read, after their declared sizes passed the caps.

    Args:
        path: the file.
        max_nodes, max_edges: the most nodes and edges a graph may have.
        max_values: the most numbers all datasets together may declare (2**28: 1 GiB of float32).
        max_bytes: the most bytes the file may hold, and its datasets declare together (the read
            budget, :data:`snnconv.io.files.MAX_FILE_BYTES`).
        max_T: the largest ``T`` the graph metadata may state.
        dt: the time step the graph is checked at (:func:`snnconv.nir.reader.parse`).

    Returns:
        the ``nir.NIRGraph``; it has passed :func:`snnconv.nir.reader.parse` at ``dt``.
        An IF of a file older than nir 1.0.6 resets by subtraction and is refused; the metadata
        of such a file records the nir version that wrote it (``nir_file_version``).

    Raises:
        NIRError: a missing, truncated, damaged, non-HDF5 or non-NIR file, a path that is not a
            regular file (a FIFO, a device, a folder), a file that refers to other files, holds
            datasets NIR's layout does not have, declares sizes beyond the caps or a T beyond
            ``max_T``, does not match its digest (``/version`` included), or holds a graph
            snnconv cannot read exactly (the message names the file and the dataset, node or edge).
        ResourceError: the machine ran out of memory within the read budget.

    Warns:
        UnverifiedFileWarning: the file carries snnconv's encoding but no digest.
    """
    import h5py

    from snnconv.nir.reader import parse

    where = os.fspath(path)
    with open_regular(where, max_bytes, error=NIRError, what="NIR file") as fh:
        size = os.fstat(fh.fileno()).st_size
        if not _is_hdf5(fh, size):
            raise NIRError(f"{where} is not an HDF5 file (a NIR file is HDF5, written by save_nir or "
                           "nir.write)")
        try:
            with h5py.File(fh, "r") as f:
                tree = read_nir_tree(f, where, max_nodes=max_nodes, max_edges=max_edges,
                                     max_values=max_values, max_bytes=max_bytes, file_bytes=size)
                version = _text(where, f["version"])
        except NIRError:
            raise
        except MemoryError as exc:
            raise ResourceError(f"{where}: the machine ran out of memory reading the file (its "
                                f"datasets passed the read budget of {max_bytes} bytes); free "
                                "memory, or refuse such files with load_nir(..., max_bytes=N)") from exc
        except RecursionError as exc:
            raise NIRError(f"{where}: cannot read as NIR: its groups nest too deep") from exc
        except Exception as exc:  # h5py raises OSError, KeyError, ValueError, RuntimeError on damage
            raise NIRError(f"{where}: cannot read as NIR (truncated or damaged?): "
                           f"{type(exc).__name__}: {exc}") from exc
    _verify(where, tree, version)
    _check_T(where, tree, max_T)
    _check_version(where, tree, version)
    try:
        graph = nir.dict2NIRNode({**tree, "type_check": False})
        if predates_v_reset(version):  # what the reader needs to know of an older file's meaning
            graph.metadata = {**(graph.metadata or {}), SOURCE_VERSION_KEY: version}
    except Exception as exc:  # nir raises ValueError, KeyError, TypeError, AssertionError
        raise NIRError(f"{where}: nir {nir.__version__} cannot build the graph: "
                       f"{type(exc).__name__}: {exc}") from exc
    try:
        parse(graph, dt=dt)
    except NIRError as exc:
        raise NIRError(f"{where}: {exc}") from exc
    return graph


def save_nir(graph: nir.NIRGraph, path: str | os.PathLike, *, compression: str | None = "gzip") -> None:
    """Write ``graph`` to ``path`` as a NIR HDF5 file with a content digest, atomically.

    The file is what ``nir.write`` writes, plus ``metadata["snnconv_digest"]``: the digest of
    the content as :func:`load_nir` reads it back, which :func:`load_nir` checks. ``graph``
    itself is not changed. ``path`` holds its old content or the whole new file, never a part;
    see :func:`snnconv.io.atomic.atomic_write_bytes` for what an interrupted write leaves and when it
    is removed.

    ``compression``: ``"gzip"`` (default, readable by any HDF5 library), ``"lzf"`` (h5py only)
    or ``None`` (fastest; a ResNet-18 file is about 25% larger).

    Raises:
        NIRError: ``graph`` is not one snnconv reads back exactly, or nir cannot serialise it.
        ConfigError: an unknown ``compression`` (a ``ValueError`` too).
    """
    import h5py

    from snnconv.nir.reader import parse

    if compression not in ("gzip", "lzf", None):
        raise ConfigError(f"compression must be 'gzip', 'lzf' or None, got {compression!r}")
    parse(graph)
    meta = {k: v for k, v in (graph.metadata or {}).items() if k not in (DIGEST_KEY, VERSION_KEY)}
    plain = nir.NIRGraph(nodes=graph.nodes, edges=graph.edges, metadata=meta, type_check=False)
    buf = io.BytesIO()
    try:
        nir.write(buf, plain, compression=compression)
        with h5py.File(buf, "r+") as f:
            inf = float("inf")
            version = f["version"][()]
            meta_group = f["node"].require_group("metadata")
            meta_group.create_dataset(VERSION_KEY, data=version, dtype=h5py.string_dtype())
            tree = read_nir_tree(f, "the graph", max_nodes=inf, max_edges=inf, max_values=inf,
                                 max_bytes=inf)
            _pop_digest(tree)
            digest = content_digest(tree)
            meta_group.create_dataset(DIGEST_KEY, data=digest, dtype=h5py.string_dtype())
    except NIRError as exc:
        raise NIRError(f"nir writes a file snnconv cannot read back: {exc}") from exc
    except Exception as exc:  # nir/h5py raise KeyError, TypeError, ValueError on odd nodes
        raise NIRError(f"nir cannot serialise the graph: {type(exc).__name__}: {exc}") from exc
    atomic_write_bytes(path, buf.getvalue())
