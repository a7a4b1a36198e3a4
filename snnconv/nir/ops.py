"""The op vocabulary: every op kind of a parsed NIR graph, defined once.

Each direction keys its own table by these names, and the tests check that every table covers
the vocabulary (``tests/test_op_vocabulary.py``):

- NIR node -> op: the strict reader (:mod:`snnconv.nir.reader`, from :attr:`OpKind.nodes`);
- module -> NIR node: the layer kinds' records (:mod:`snnconv.kinds`: the ops each is written
  as, or why NIR has none) and their writers (``WRITERS`` of :mod:`snnconv.snn.nir_io`);
- op -> torch module: ``READERS`` of :mod:`snnconv.snn.nir_io`;
- op -> executor: the dense executor's builders (``OP_BUILDERS`` of
  ``snnconv_backends.engine.ops``; neurons are built by its plan) and MAC counts (``MACS`` of
  ``snnconv_backends.engine.stats``);
- op -> Loihi 2: the linear ops (``APPLY`` of ``snnconv_backends.loihi2.ops``) run off-chip in
  the encoder or fold into a neuron population's synapses; the neurons are populations.

A new op kind is a row here, then one entry in each of those tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["OpKind", "OPS", "ROLES", "WEIGHTED", "PASS", "LINEAR", "NEURONS", "flatten_dims"]

#: What an op does to what flows through it.
ROLES = {
    "io": "the graph's input or output",
    "weighted": "a linear map with weights (synaptic operations are counted into it)",
    "pass": "a linear map without weights that spikes pass through unmultiplied",
    "neuron": "snnconv's IF neuron (NIR's IF, or its I/Threshold/Scale(-theta) pattern)",
    "leaky": "one of NIR's leaky neurons",
}


@dataclass(frozen=True)
class OpKind:
    """One op kind: its role (a key of :data:`ROLES`) and the NIR node types read as it."""

    role: str
    nodes: tuple[str, ...]

    @property
    def linear(self) -> bool:
        """Whether the op is a linear map (Loihi's static encoder, chains between neurons)."""
        return self.role in ("weighted", "pass")


#: op kind -> what it is. ``sum`` is NIR's ``Identity``, the node where several edges add.
OPS: MappingProxyType[str, OpKind] = MappingProxyType({
    "input": OpKind("io", ("Input",)),
    "output": OpKind("io", ("Output",)),
    "conv1d": OpKind("weighted", ("Conv1d",)),
    "conv2d": OpKind("weighted", ("Conv2d",)),
    "affine": OpKind("weighted", ("Affine",)),
    "linear": OpKind("weighted", ("Linear",)),
    "scale": OpKind("weighted", ("Scale",)),
    "avgpool2d": OpKind("pass", ("AvgPool2d",)),
    "sumpool2d": OpKind("pass", ("SumPool2d",)),
    "flatten": OpKind("pass", ("Flatten",)),
    "sum": OpKind("pass", ("Identity",)),
    "neuron": OpKind("neuron", ("IF", "I", "Threshold")),
    "lif": OpKind("leaky", ("LIF",)),
    "cubalif": OpKind("leaky", ("CubaLIF",)),
    "li": OpKind("leaky", ("LI",)),
})

#: Ops that carry weights (synaptic operations are counted into these).
WEIGHTED = tuple(k for k, op in OPS.items() if op.role == "weighted")
#: Ops a spike passes through on its way to a weighted op without being multiplied.
PASS = tuple(k for k, op in OPS.items() if op.role == "pass")
#: Ops that are linear maps.
LINEAR = tuple(k for k, op in OPS.items() if op.linear)
#: Ops that are neurons (snnconv's IF and NIR's leaky ones).
NEURONS = tuple(k for k, op in OPS.items() if op.role in ("neuron", "leaky"))


def flatten_dims(start: int, end: int, ndim: int) -> tuple[int, int]:
    """A NIR ``Flatten``'s batch-free dims (``ndim`` of them) as dims of the batched tensor."""
    start = start + ndim if start < 0 else start
    end = end + ndim if end < 0 else end
    return start + 1, end + 1
