"""The cpu backend: bit-identical to the torch SpikingNetwork after a NIR round trip, exact
statistics (spike counts, synaptic operations against spikingjelly's op_counter, MACs), and
clear BackendErrors on bad input."""

from __future__ import annotations

import math

import nir
import numpy as np
import pytest
import torch
from _zoo import NARROW as _NARROW

import snnconv
from snnconv import models
from snnconv.errors import BackendError
from snnconv.nir.format import COMPARE, spec_threshold
from snnconv.nir.reader import parse
from snnconv.snn.nir_io import export_nir
from snnconv_backends import get
from snnconv_backends.cpu import compile_parsed

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

SHAPE = (3, 16, 16)


def _shape(name: str) -> tuple[int, ...]:
    return (3, 32, 32) if name.startswith("vgg") else SHAPE  # five 2x2 poolings


def test_every_zoo_network_is_covered():
    assert sorted(_NARROW) == models.names()


def _convert(name: str, *, per_channel=False, reset="subtract", T=3, seed=0, burst=1):
    """A narrow zoo network converted on random data (a cheap, real conversion)."""
    torch.manual_seed(seed)
    model = _NARROW[name](SHAPE[0])
    x = torch.rand(8, *_shape(name))
    snn, _ = snnconv.convert(model, [(x, torch.zeros(8, dtype=torch.long))], T=T, L=4,
                             calib_batches=1, per_channel=per_channel, bias_calibration=False,
                             maxpool="avg", reset=reset, progress=False, burst=burst,
                             on_collapse="warn")  # random weights: a silent layer is no error here
    return snn


def _assert_same_as_snn(snn, x: torch.Tensor, T: int, **options) -> "snnconv.backends.RunResult":
    """cpu backend on the exported graph == snn.run, bit for bit (outputs and spike counts)."""
    program = get("cpu").compile(export_nir(snn, input_shape=tuple(x.shape[1:])), **options)
    with torch.no_grad():
        ref, counts = snn.run(x, T, spike_counts=True)
    result = program.run(x, T)
    assert result.outputs.dtype == ref.dtype and result.outputs.shape == ref.shape
    assert torch.equal(result.outputs, ref), (result.outputs - ref).abs().max()
    assert set(result.spikes) == set(counts)
    for name, c in counts.items():
        assert torch.equal(result.spikes[name], c.double()), name
    return result


@pytest.mark.parametrize("reset", ["subtract", "zero"])
@pytest.mark.parametrize("name", sorted(_NARROW))
def test_cpu_is_bit_identical_to_the_torch_snn_on_the_zoo(name, reset):
    snn = _convert(name, reset=reset)
    # chunks of 2 inputs at T=3 (chunk_size 7), the last of one input: the same batch
    # composition as SpikingNetwork's, which oneDNN's and MKL's rounding depends on
    snn.chunk_size = 7
    x = torch.randn(5, *_shape(name))
    result = _assert_same_as_snn(snn, x, 3, chunk_size=7)
    assert result.extra["chunk_inputs"] == 2
    assert sum(float(c.sum()) for c in result.spikes.values()) > 0


@pytest.mark.parametrize("reset", ["subtract", "zero"])
@pytest.mark.parametrize("name", ["small_cnn", "resnet8"])
def test_per_channel_thresholds_at_several_T(name, reset):
    snn = _convert(name, per_channel=True, reset=reset)
    x = torch.randn(6, *SHAPE)
    for T in (1, 2, 5):
        _assert_same_as_snn(snn, x, T)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("name", ["small_cnn", "resnet8"])
def test_burst_neurons_are_bit_identical_after_a_nir_round_trip(name, per_channel):
    """Neurons of bursts (up to B spikes a step) through their NIR form (B Thresholds and a sum)."""
    snn = _convert(name, per_channel=per_channel, burst=3)
    x = 3 * torch.randn(5, *_shape(name))  # strong inputs: counts above 1
    for T in (1, 3):
        result = _assert_same_as_snn(snn, x, T)
        assert max(float(c.max()) for c in result.spikes.values()) > T  # bursts happened


def test_float64_on_request_matches_the_double_snn():
    snn = _convert("resnet8").double()
    x = torch.randn(4, *SHAPE, dtype=torch.float64)
    program = get("cpu").compile(export_nir(snn.float(), input_shape=SHAPE), dtype="float64")
    snn = snn.double()
    with torch.no_grad():
        ref = snn.run(x, 4)
    result = program.run(x, 4)
    assert result.outputs.dtype == torch.float64 and torch.equal(result.outputs, ref)


@pytest.mark.slow
def test_compiled_neuron_kernel_gives_the_same_bits():
    """neuron="compiled" (one torch.compile kernel per neuron layer) == the in-place loop."""
    snn = _convert("resnet8", per_channel=True)
    x = torch.randn(3, *SHAPE)
    _assert_same_as_snn(snn, x, 2, neuron="compiled")
    _assert_same_as_snn(_convert("resnet8", burst=3), 3 * x, 2, neuron="compiled")


def test_a_sequence_input_of_repeated_frames_is_the_static_input():
    snn = _convert("small_cnn")
    program = get("cpu").compile(export_nir(snn, input_shape=SHAPE))
    x = torch.randn(4, *SHAPE)
    static = program.run(x, 3)
    seq = program.run(x.unsqueeze(0).expand(3, *x.shape).contiguous(), 3)
    assert seq.outputs.shape == static.outputs.shape
    # the first layer runs on [T*b] instead of [b] images: equal up to float rounding
    torch.testing.assert_close(seq.outputs, static.outputs, rtol=1e-4, atol=1e-4)


# --- a hand-written graph: golden trajectories ------------------------------------------------

def _one_neuron_graph(theta: float, reset: str) -> nir.NIRGraph:
    """input(1) -> affine(1, 0) -> one IF neuron -> linear(1) -> output."""
    one = np.ones((1, 1), np.float32)
    nodes = {"input": nir.Input(np.array([1])), "fc": nir.Affine(weight=one, bias=np.zeros(1, np.float32)),
             "out": nir.Linear(weight=one), "output": nir.Output(np.array([1]))}
    th = np.full(1, theta, np.float32)
    if reset == "subtract":
        nodes["n"] = nir.I(r=np.ones(1, np.float32), metadata={"snnconv_neuron": "if", "reset": "subtract",
                                                             "v_init": 0.5, "compare": COMPARE})
        nodes["n_fire"] = nir.Threshold(spec_threshold(th / np.float32(2)))
        nodes["n_reset"] = nir.Scale(-th)
        edges = [("input", "fc"), ("fc", "n"), ("n", "n_fire"), ("n_fire", "n_reset"),
                 ("n_reset", "n"), ("n_fire", "out"), ("out", "output")]
    else:
        nodes["n"] = nir.IF(r=np.ones(1, np.float32), v_threshold=th, v_reset=np.zeros(1, np.float32))
        edges = [("input", "fc"), ("fc", "n"), ("n", "out"), ("out", "output")]
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata={"reset": reset, "T": 6}, type_check=False)


@pytest.mark.parametrize("reset, expected", [
    # theta 2, input 0.6: u = 0.3 per step from v = 0.5 -> h = .8 1.1 .4 .7 1.0 .3
    ("subtract", [0, 1, 0, 0, 1, 0]),
    # theta 2, input 0.6 from v = 0 -> h = .6 1.2 1.8 2.4 -> spike, 0 -> .6 1.2
    ("zero", [0, 0, 0, 1, 0, 0]),
])
def test_golden_spike_train_of_one_neuron(reset, expected):
    program = get("cpu").compile(_one_neuron_graph(2.0, reset))
    result = program.run(torch.full((1, 1), 0.6), 6)
    assert result.outputs.reshape(-1).tolist() == expected
    assert result.spikes["n"].tolist() == expected
    assert result.synops == {"out": float(sum(expected))}  # one output per spike
    assert result.macs == {"fc": 1.0, "out": 1.0}
    assert program.default_T == 6 and program.run(torch.full((1, 1), 0.6)).outputs.shape[0] == 6


# --- statistics ----------------------------------------------------------------------------

def test_synaptic_operations_agree_with_spikingjelly_op_counter():
    """Layers fed directly by spikes: ours == spikingjelly's SynOpCounter (exact occupancy)."""
    from spikingjelly.activation_based.op_counter import DispatchCounterMode, SynOpCounter

    snn = _convert("resnet8")
    x = torch.randn(4, *SHAPE)
    graph = export_nir(snn, input_shape=SHAPE)
    parsed = parse(graph)
    result = compile_parsed(parsed).run(x, 3)
    counter = SynOpCounter()
    with torch.no_grad(), DispatchCounterMode([counter]):
        snn.run(x, 3)
    theirs = counter.get_total()
    direct = [op.name for op in parsed.ops if op.kind in ("conv2d", "affine", "linear")
              and all(parsed.op(i).kind == "neuron" for i in op.inputs)]
    assert len(direct) >= 4  # conv1/conv2 of each block and the shortcut convs
    assert sum(result.synops[n] for n in direct) == theirs
    # and the MACs are the ANN's synapses (padding excluded): per image, once (not x T), the
    # same total as the torch network's analysis (what evaluate and the report show)
    from snnconv.analysis.activity import analyse
    from snnconv.analysis.energy import conv_macs

    conv = parsed.op(direct[0])
    w = conv.params["weight"]
    assert result.macs[conv.name] == 4 * conv_macs(conv.in_shape, w.shape, conv.params["stride"],
                                                   conv.params["padding"], conv.params["dilation"])
    assert result.macs[conv.name] < 4 * math.prod(conv.out_shape) * math.prod(w.shape[1:])  # padded
    assert sum(result.macs.values()) == sum(analyse(snn, x, 3).macs.values())


def test_synops_of_a_layer_after_global_pooling_count_the_fan_out_of_each_spike():
    snn = _convert("resnet8")
    parsed = parse(export_nir(snn, input_shape=SHAPE))
    result = compile_parsed(parsed).run(torch.randn(3, *SHAPE), 2)
    fc = next(op for op in parsed.ops if op.kind == "affine")
    pool = parsed.op(parsed.op(fc.inputs[0]).inputs[0]) if parsed.op(fc.inputs[0]).kind == "flatten" \
        else parsed.op(fc.inputs[0])
    sources = [parsed.op(i) for i in pool.inputs]
    assert all(s.kind == "neuron" for s in sources)
    spikes = sum(float(result.spikes[s.name].sum()) for s in sources)
    assert result.synops[fc.name] == spikes * fc.params["weight"].shape[0]


# --- bad input -----------------------------------------------------------------------------

def test_bad_input_is_refused_with_a_backend_error():
    program = get("cpu").compile(_one_neuron_graph(1.0, "subtract"))
    with pytest.raises(BackendError, match=r"input shape \(2, 3\).*\(1,\)"):
        program.run(torch.zeros(2, 3), 4)
    with pytest.raises(BackendError, match="dtype torch.int64"):
        program.run(torch.zeros(2, 1, dtype=torch.long), 4)
    with pytest.raises(BackendError, match="T .* >= 1, got 0"):
        program.run(torch.zeros(2, 1), 0)
    with pytest.raises(BackendError, match="got 2.5"):
        program.run(torch.zeros(2, 1), 2.5)
    with pytest.raises(BackendError, match="5 steps but T=4"):
        program.run(torch.zeros(5, 2, 1), 4)
    with pytest.raises(BackendError, match="empty"):
        program.run(torch.zeros(0, 1), 4)
    with pytest.raises(BackendError, match="torch.Tensor"):
        program.run(np.zeros((2, 1), np.float32), 4)


def test_bad_graphs_and_options_are_refused_naming_them():
    cpu = get("cpu")
    graph = _one_neuron_graph(1.0, "subtract")
    graph.nodes["n_leak"] = nir.CubaLI(tau_syn=np.ones(1, np.float32), tau_mem=np.ones(1, np.float32),
                                       r=np.ones(1, np.float32), v_leak=np.zeros(1, np.float32))
    graph.edges.append(("fc", "n_leak"))
    graph.edges.append(("n_leak", "out"))
    with pytest.raises(BackendError, match="n_leak"):
        cpu.compile(graph)
    with pytest.raises(BackendError, match="no option 'fast'.*chunk_size"):
        cpu.compile(_one_neuron_graph(1.0, "zero"), fast=True)
    with pytest.raises(BackendError, match="dtype 'float16'"):
        cpu.compile(_one_neuron_graph(1.0, "zero"), dtype="float16")
    with pytest.raises(BackendError, match="neuron must be"):
        cpu.compile(_one_neuron_graph(1.0, "zero"), neuron="fast")
    with pytest.raises(BackendError, match="nir.NIRGraph"):
        cpu.compile("model.nir")
