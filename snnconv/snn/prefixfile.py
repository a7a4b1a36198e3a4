"""The analog prefix of an exported network, as a file beside its NIR file.

NIR 1.0.8 has no max-pooling or ReLU node, so a network whose static analog prefix
(:mod:`snnconv.constructs.prefix`: a ResNet stem with its max-pooling) runs outside the spiking graph is
exported as two files: the NIR graph, whose input is the prefix's output
(``metadata["input"] == "analog_prefix"``), and the prefix as a :class:`SpikingNetwork` file
beside it (T=1, no neurons), named in the graph's metadata with the SHA-256 of its bytes.
``snnconv export`` writes both and ``snnconv run`` reads both.
"""

from __future__ import annotations

import hashlib
import io
import os

import nir
import torch.fx as fx
import torch.nn as nn

from snnconv.constructs.prefix import PREFIX_NAME, analog_prefix
from snnconv.errors import CheckpointError, NIRError
from snnconv.io.files import open_regular
from snnconv.nir.format import ANALOG_PREFIX, INPUT_KEY, PREFIX_FILE_KEY, PREFIX_SHA256_KEY
from snnconv.snn.network import SpikingNetwork

__all__ = ["MAX_PREFIX_BYTES", "save_prefix", "load_prefix"]


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
