"""The gpu backend: refused clearly without CUDA; its code path (bfloat16, tie counting,
deterministic settings) exercised on the CPU device; on CUDA, agreement with the cpu backend."""

from __future__ import annotations

import nir
import numpy as np
import pytest
import torch

from snnconv.errors import BackendError
from snnconv.nir.format import COMPARE, spec_threshold
from snnconv_backends import available, get
from snnconv_backends.gpu import GPUBackend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _graph(reset: str = "subtract") -> nir.NIRGraph:
    """input(3) -> affine -> IF (per-channel thresholds) -> affine -> output(2)."""
    rng = np.random.default_rng(0)
    th = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    nodes = {"input": nir.Input(np.array([3])),
             "fc1": nir.Affine(weight=rng.standard_normal((4, 3)).astype(np.float32),
                               bias=rng.standard_normal(4).astype(np.float32)),
             "fc2": nir.Affine(weight=rng.standard_normal((2, 4)).astype(np.float32),
                               bias=np.zeros(2, np.float32)),
             "output": nir.Output(np.array([2]))}
    if reset == "subtract":
        nodes["n"] = nir.I(r=np.ones(4, np.float32), metadata={"snnconv_neuron": "if", "reset": "subtract",
                                                             "v_init": 0.5, "compare": COMPARE})
        nodes["n_fire"] = nir.Threshold(spec_threshold(th / np.float32(2)))
        nodes["n_reset"] = nir.Scale(-th)
        edges = [("input", "fc1"), ("fc1", "n"), ("n", "n_fire"), ("n_fire", "n_reset"),
                 ("n_reset", "n"), ("n_fire", "fc2"), ("fc2", "output")]
    else:
        nodes["n"] = nir.IF(r=np.ones(4, np.float32), v_threshold=th, v_reset=np.zeros(4, np.float32))
        edges = [("input", "fc1"), ("fc1", "n"), ("n", "fc2"), ("fc2", "output")]
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata={"reset": reset}, type_check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_gpu_backend_is_refused_with_the_reason():
    ok, reason = available()["gpu"]
    assert not ok and "no CUDA device" in reason
    with pytest.raises(BackendError, match="'gpu' is not usable here: no CUDA device"):
        get("gpu")
    with pytest.raises(BackendError, match="no CUDA device.*use the cpu backend"):
        GPUBackend().compile(_graph())


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_gpu_code_path_on_the_cpu_device_matches_the_cpu_backend(reset):
    x = torch.randn(64, 3)
    ref = get("cpu").compile(_graph(reset)).run(x, 7)
    prog = GPUBackend().compile(_graph(reset), device="cpu", count_ties=True, tie_tolerance=0.0)
    r = prog.run(x, 7)
    assert torch.equal(r.outputs, ref.outputs)
    assert all(torch.equal(r.spikes[k], ref.spikes[k]) for k in ref.spikes)
    assert r.synops == ref.synops and r.macs == ref.macs
    assert r.extra["threshold_ties"] >= 0 and r.extra["neuron"] == "loop"


def test_threshold_ties_are_counted():
    """Input exactly on the threshold every other step is a tie (within any tolerance)."""
    one = np.ones((1, 1), np.float32)
    nodes = {"input": nir.Input(np.array([1])), "fc": nir.Affine(weight=one, bias=np.zeros(1, np.float32)),
             "n": nir.IF(r=np.ones(1, np.float32), v_threshold=np.ones(1, np.float32),
                         v_reset=np.zeros(1, np.float32)),
             "output": nir.Output(np.array([1]))}
    graph = nir.NIRGraph(nodes=nodes, edges=[("input", "fc"), ("fc", "n"), ("n", "output")],
                         metadata={"reset": "zero"}, type_check=False)
    # read firing on h >= 1 (NIR's own: h > 1)
    r = GPUBackend().compile(graph, device="cpu", count_ties=True, compare=">=").run(torch.full((3, 1), 0.5), 4)
    assert r.outputs.reshape(4, 3)[:, 0].tolist() == [0, 1, 0, 1]   # h = .5, 1 (tie), .5, 1 (tie)
    assert r.extra["threshold_ties"] == 2 * 3


def test_bfloat16_layers_keep_binary_spikes_and_float32_membranes():
    x = torch.randn(32, 3)
    r = GPUBackend().compile(_graph(), device="cpu", dtype="bfloat16").run(x, 5)
    assert r.outputs.dtype == torch.bfloat16 and r.outputs.shape == (5, 32, 2)
    ref = get("cpu").compile(_graph()).run(x, 5)
    total = sum(float(s.sum()) for s in ref.spikes.values())
    diff = sum(float((r.spikes[k] - ref.spikes[k]).abs().sum()) for k in ref.spikes)
    assert diff <= 0.1 * total  # bfloat16 weights move some membranes across the threshold


def test_bad_options_are_refused():
    gpu = GPUBackend()
    with pytest.raises(BackendError, match="dtype 'float64'"):
        gpu.compile(_graph(), device="cpu", dtype="float64")
    with pytest.raises(BackendError, match="no option 'streams'"):
        gpu.compile(_graph(), device="cpu", streams=2)
    with pytest.raises(BackendError, match="bad device"):
        gpu.compile(_graph(), device="tpu:9")
    with pytest.raises(BackendError, match="neuron must be"):
        gpu.compile(_graph(), device="cpu", neuron="cupy")


@pytest.mark.cuda
@cuda
def test_on_cuda_float32_deterministic_spikes_equal_the_cpu_backend_up_to_ties():
    x = torch.randn(256, 3)
    ref = get("cpu").compile(_graph()).run(x, 8)
    r = get("gpu").compile(_graph(), count_ties=True, tie_tolerance=1e-5).run(x, 8)
    diff = sum(float((r.spikes[k] - ref.spikes[k]).abs().sum()) for k in ref.spikes)
    assert diff <= r.extra["threshold_ties"]
    again = get("gpu").compile(_graph(), count_ties=True).run(x, 8)
    assert torch.equal(again.outputs, r.outputs)  # deterministic: repeatable


@pytest.mark.cuda
@cuda
def test_on_cuda_compiled_neuron_equals_the_loop():
    x = torch.randn(64, 3)
    a = get("gpu").compile(_graph(), neuron="compiled").run(x, 4)
    b = get("gpu").compile(_graph(), neuron="loop").run(x, 4)
    assert torch.equal(a.outputs, b.outputs)
