"""Small NIR graphs in snnconv's encoding and an exact comparison of graphs (file tests)."""

from __future__ import annotations

from typing import Any

import nir
import numpy as np

from snnconv.nir.format import fire_threshold, graph_metadata, neuron_metadata, spec_threshold


def tiny_graph(reset: str = "subtract", T: int = 4, hidden: int = 4) -> nir.NIRGraph:
    """input(3) -> fc1 (Affine) -> neuron n1 -> fc2 (Linear) -> output(2), snnconv's encoding."""
    rng = np.random.default_rng(0)
    theta = np.full(hidden, 0.75, np.float32)
    nodes: dict[str, nir.NIRNode] = {
        "input": nir.Input(np.array([3])),
        "fc1": nir.Affine(weight=rng.standard_normal((hidden, 3)).astype(np.float32),
                          bias=rng.standard_normal(hidden).astype(np.float32)),
        "fc2": nir.Linear(weight=rng.standard_normal((2, hidden)).astype(np.float32)),
        "output": nir.Output(np.array([2])),
    }
    edges = [("input", "fc1")]
    if reset == "subtract":
        nodes["n1"] = nir.I(r=np.ones(hidden, np.float32),
                            metadata=neuron_metadata("subtract", 0.5, False))
        nodes["n1_fire"] = nir.Threshold(spec_threshold(fire_threshold(theta, np.float32(0.5))))
        nodes["n1_reset"] = nir.Scale(-theta)
        edges += [("fc1", "n1"), ("n1", "n1_fire"), ("n1_fire", "n1_reset"), ("n1_reset", "n1"),
                  ("n1_fire", "fc2")]
    else:
        nodes["n1"] = nir.IF(r=np.ones(hidden, np.float32), v_threshold=spec_threshold(theta),
                             v_reset=np.zeros(hidden, np.float32),
                             metadata=neuron_metadata("zero", 0.0, False))
        edges += [("fc1", "n1"), ("n1", "fc2")]
    edges.append(("fc2", "output"))
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=graph_metadata(T, reset), type_check=False)


def chain_graph(n_layers: int, width: int = 2) -> nir.NIRGraph:
    """input -> ``n_layers`` Linear nodes -> output: a graph of ``n_layers + 2`` nodes."""
    eye = np.eye(width, dtype=np.float32)
    nodes: dict[str, nir.NIRNode] = {"input": nir.Input(np.array([width]))}
    edges, prev = [], "input"
    for i in range(n_layers):
        nodes[f"l{i}"] = nir.Linear(weight=eye.copy())
        edges.append((prev, f"l{i}"))
        prev = f"l{i}"
    nodes["output"] = nir.Output(np.array([width]))
    edges.append((prev, "output"))
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata={}, type_check=False)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and \
            all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) \
            and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return type(a) is type(b) and a == b
    x, y = np.asarray(a), np.asarray(b)
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def same_graph(a: nir.NIRGraph, b: nir.NIRGraph) -> bool:
    """The same nodes (names, types, every field's dtype, shape and values), edges and metadata."""
    return _same(a.to_dict(), b.to_dict())
