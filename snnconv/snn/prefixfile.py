"""The analog prefix of an exported network, as a file beside its NIR file.

NIR 1.0.8 has no max-pooling or ReLU node, so a network whose static analog prefix
(:mod:`snnconv.constructs.prefix`: a ResNet stem with its max-pooling) runs outside the spiking graph is
exported as two files: the NIR graph, whose input is the prefix's output
(``metadata["input"] == "analog_prefix"``), and the prefix as a :class:`SpikingNetwork` file
beside it (T=1, no neurons), named in the graph's metadata with the SHA-256 of its bytes.
``snnconv export`` writes both and ``snnconv run`` reads both; :func:`save_nir` and
:func:`load_nir` (``snnconv.save_nir``, ``snnconv.load_nir``) write and read a network with its
prefix in one call.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Literal, overload

import nir
import torch.fx as fx
import torch.nn as nn

from snnconv.errors import CheckpointError, NIRError
from snnconv.io.files import open_regular
from snnconv.nir.file import load_nir as _load_graph
from snnconv.nir.file import save_nir as _save_graph
from snnconv.nir.format import ANALOG_PREFIX, INPUT_KEY, PREFIX_FILE_KEY, PREFIX_SHA256_KEY
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.timing import PREFIX_NAME, analog_prefix

__all__ = ["MAX_PREFIX_BYTES", "save_prefix", "load_prefix", "save_nir", "load_nir"]


#: The largest prefix file :func:`load_prefix` reads (a stem: a ResNet-50's is 38 KB).
MAX_PREFIX_BYTES = 256 * 2**20


def save_prefix(snn: SpikingNetwork, graph: nir.NIRGraph, nir_path: str | os.PathLike) -> str | None:
    """Write the analog prefix of ``snn`` beside the NIR file ``nir_path`` (before
    :func:`save_nir` writes the graph), and name it in ``graph.metadata``.

    The prefix file is a :class:`SpikingNetwork` file (``<stem>.prefix.pt``, T=1) whose output is
    the graph's input; ``graph.metadata`` gets its file name and the SHA-256 of its bytes, which
    :func:`load_prefix` checks. Returns its path, or None where ``snn`` has no prefix (then
    nothing is written and ``graph`` is unchanged).
    """
    prefix = analog_prefix(snn)
    if prefix is None:
        return None
    if (graph.metadata or {}).get(INPUT_KEY) != ANALOG_PREFIX:
        raise NIRError("the graph does not read an analog prefix's output: export it from the same "
                       "network (export_nir(snn))")
    root = nn.Module()
    root.add_module(PREFIX_NAME, prefix)
    g = fx.Graph()
    g.output(g.call_module(PREFIX_NAME, (g.placeholder("x"),)))
    net = SpikingNetwork(fx.GraphModule(root, g, "AnalogPrefixGraph"), T=1)
    net.meta = {"input_shape": list(snn.meta.get("input_shape") or []), "role": ANALOG_PREFIX,
                "output_shape": list(graph.nodes["input"].input_type["input"])}
    stem, _ = os.path.splitext(os.fspath(nir_path))
    path = stem + ".prefix.pt"
    net.save(path)
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    graph.metadata[PREFIX_FILE_KEY] = os.path.basename(path)
    graph.metadata[PREFIX_SHA256_KEY] = digest
    return path


def load_prefix(graph: nir.NIRGraph, nir_path: str | os.PathLike,
                path: str | os.PathLike | None = None) -> SpikingNetwork | None:
    """The analog prefix a graph read from ``nir_path`` reads from: None where its input is the
    network's input; else the network file named in its metadata, beside ``nir_path`` (or
    ``path``), checked against the SHA-256 the graph records. Call it on an image batch and feed
    its output to the graph.

    Raises:
        NIRError: ``path`` is given for a graph that reads no prefix; the graph names no prefix
            file, or a name that is not a plain file name; the file is missing, not a regular
            file (a FIFO, a device, a folder: refused without blocking,
            :func:`snnconv.io.files.open_regular`), larger than :data:`MAX_PREFIX_BYTES`, differs
            from the one the graph was saved with, or is not a saved network.
    """
    meta = graph.metadata or {}
    where = os.fspath(nir_path)
    if meta.get(INPUT_KEY) != ANALOG_PREFIX:
        if path is not None:
            raise NIRError(f"{where} reads the network's input, not an analog prefix's output: "
                           f"run it without the prefix file {os.fspath(path)}")
        return None
    name, digest = meta.get(PREFIX_FILE_KEY), meta.get(PREFIX_SHA256_KEY)
    if path is None:
        if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
            raise NIRError(f"{where}: the graph reads the output of an analog prefix, but names no "
                           f"prefix file it can be read from (found {name!r}); give its path")
        path = os.path.join(os.path.dirname(where), name)
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise NIRError(f"{where}: the graph reads the output of an analog prefix saved as {path}, "
                       "which is missing: keep it beside the NIR file (snnconv export writes both), "
                       "or give its path")
    with open_regular(path, MAX_PREFIX_BYTES, error=NIRError, what="analog prefix file") as fh:
        data = fh.read(os.fstat(fh.fileno()).st_size + 1)  # within the bound: checked on opening
    if len(data) > MAX_PREFIX_BYTES:  # it grew since it was opened
        raise NIRError(f"{path}: more than the {MAX_PREFIX_BYTES} bytes an analog prefix file may hold")
    if not isinstance(digest, str) or hashlib.sha256(data).hexdigest() != digest:
        raise NIRError(f"{path} is not the analog prefix {where} was saved with (its SHA-256 does "
                       "not match the graph's); export the network again")
    try:
        net = SpikingNetwork.load(io.BytesIO(data))
    except CheckpointError as exc:
        raise NIRError(f"{path}: {exc}") from exc
    if net.meta.get("role") != ANALOG_PREFIX:
        raise NIRError(f"{path} is a saved network, not an analog prefix")
    return net


def save_nir(network: SpikingNetwork | nir.NIRGraph, path: str | os.PathLike, *,
             compression: str | None = "gzip") -> nir.NIRGraph:
    """Write ``network`` to the NIR file ``path``: a :class:`SpikingNetwork` is exported
    (:func:`snnconv.export_nir`, at the input shape ``convert()`` recorded) and its analog prefix,
    if it has one, written beside (:func:`save_prefix`); a ``nir.NIRGraph`` is written as it is.
    The file is HDF5 with a content digest, written atomically
    (:func:`snnconv.nir.file.save_nir`, whose ``compression`` this takes). Returns the graph
    written; :func:`load_nir` with ``with_prefix=True`` reads both back.

    Raises:
        NIRError: the network has no NIR form, or nir cannot serialise the graph.
    """
    if isinstance(network, SpikingNetwork):
        from snnconv.snn.nir_io import export_nir

        graph = export_nir(network)
        save_prefix(network, graph, path)
    elif isinstance(network, nir.NIRGraph):
        graph = network
    else:
        raise NIRError(f"save_nir writes a SpikingNetwork or a nir.NIRGraph, got {type(network).__name__}")
    _save_graph(graph, path, compression=compression)
    return graph


@overload
def load_nir(path: str | os.PathLike, *, with_prefix: Literal[False] = False, **caps: Any) -> nir.NIRGraph: ...
@overload
def load_nir(path: str | os.PathLike, *, with_prefix: Literal[True], **caps: Any
             ) -> tuple[nir.NIRGraph, nn.Module]: ...
def load_nir(path: str | os.PathLike, *, with_prefix: bool = False,
             **caps: Any) -> nir.NIRGraph | tuple[nir.NIRGraph, nn.Module]:
    """Read the NIR file ``path`` strictly (:func:`snnconv.nir.file.load_nir`, whose size caps
    and ``dt`` ``caps`` passes on). With ``with_prefix=True``: ``(graph, prefix)``, where
    ``prefix`` maps a batch of images to the graph's input: the analog prefix saved beside the
    file (:func:`load_prefix`, its digest checked) or, where the graph reads the images
    themselves, ``nn.Identity()``::

        graph, prefix = snnconv.load_nir("snn.nir", with_prefix=True)
        result = snnconv.backends.get("cpu").compile(graph).run(prefix(images), T=4)

    Raises:
        NIRError: what :func:`snnconv.nir.file.load_nir` and :func:`load_prefix` refuse.
    """
    graph = _load_graph(path, **caps)
    if not with_prefix:
        return graph
    prefix = load_prefix(graph, path)
    return graph, (prefix if prefix is not None else nn.Identity())
