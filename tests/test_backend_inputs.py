"""What every backend refuses by name before it runs: NaN or infinite inputs, an empty batch, a
graph holding a node it does not run (``BackendError``, never the reader's ``NIRError``); and the
torch ``SpikingNetwork`` refusing non-finite inputs (``DataError``)."""

from __future__ import annotations

import nir
import numpy as np
import pytest
import torch
from _loihi_nets import small_graph

from snnconv.errors import BackendError, DataError
from snnconv_backends.cpu import CPUBackend
from snnconv_backends.gpu import GPUBackend
from snnconv_backends.lava import LavaBackend
from snnconv_backends.loihi2 import Loihi2SimBackend

#: Every built-in backend, compiled without a GPU or the Lava side environment (the lava
#: program checks its input before it starts Lava).
PROGRAMS = {
    "cpu": lambda g: CPUBackend().compile(g),
    "gpu": lambda g: GPUBackend().compile(g, device="cpu"),
    "loihi2-sim": lambda g: Loihi2SimBackend().compile(g),
    "lava": lambda g: LavaBackend().compile(g, python="/nonexistent/python3.10"),
}


@pytest.fixture(scope="module")
def graph():
    return small_graph("subtract")


@pytest.mark.parametrize("backend", sorted(PROGRAMS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_refused_by_every_backend(graph, backend, bad):
    x = torch.rand(3, 1, 8, 8)
    x[1, 0, 2, 5] = bad
    with pytest.raises(BackendError, match=r"1 NaN or infinite value\(s\), the first at index \(1, 0, 2, 5\)"):
        PROGRAMS[backend](graph).run(x, 2)


@pytest.mark.parametrize("backend", ["loihi2-sim", "lava"])
def test_an_empty_batch_is_refused_by_the_loihi_backends(graph, backend):
    with pytest.raises(BackendError, match="the batch is empty"):
        PROGRAMS[backend](graph).run(torch.rand(0, 1, 8, 8), 2)


def _graph_with_a_delay() -> nir.NIRGraph:
    """Input -> Affine -> Delay -> Output: a NIR node no snnconv backend runs."""
    w = np.ones((2, 3), np.float32)
    return nir.NIRGraph(
        nodes={"input": nir.Input(input_type=np.array([3])),
               "fc": nir.Affine(weight=w, bias=np.zeros(2, np.float32)),
               "late": nir.Delay(delay=np.ones(2, np.float32)),
               "output": nir.Output(output_type=np.array([2]))},
        edges=[("input", "fc"), ("fc", "late"), ("late", "output")])


@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_a_node_a_backend_lacks_is_a_backend_error_naming_it(backend):
    with pytest.raises(BackendError, match=rf"backend '{backend}' cannot run this graph: node 'late'"):
        PROGRAMS[backend](_graph_with_a_delay())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_spiking_network_refuses_non_finite_inputs(small_digits_snn, bad):
    x = torch.rand(4, 1, 8, 8)
    x[2, 0, 0, 0] = bad
    with pytest.raises(DataError, match=r"1 NaN or infinite value\(s\)"):
        small_digits_snn.run(x, T=2)
    with pytest.raises(DataError, match="NaN or infinite"):
        small_digits_snn(x)
