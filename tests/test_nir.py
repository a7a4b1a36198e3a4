"""NIR export, the strict reader (snnconv.nir.reader.parse), files and round trips."""

from __future__ import annotations

import os

import h5py
import nir
import numpy as np
import pytest
import torch
import torch.nn as nn
from _probes import run_with_spikes, spikingjelly_run
from _zoo import NARROW as _NARROW

import snnconv
from snnconv import models
from snnconv.errors import NIRError, SnnconvError
from snnconv.nir.format import COMPARE, spec_threshold
from snnconv.nir.reader import KINDS, ParsedGraph, parse
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import IFNeuron, Scale, TimeExpand, neurons
from snnconv.snn.nir_io import export_nir, from_nir, load_nir, save_nir

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too




def test_every_zoo_network_has_a_narrow_twin():
    assert sorted(_NARROW) == models.names()


def _convert(name: str, shape=(3, 16, 16), *, per_channel=False, T=4, seed=0, reset="subtract"):
    """A narrow zoo network converted on random data (a cheap, real conversion)."""
    torch.manual_seed(seed)
    model = _NARROW[name](shape[0])
    x = torch.rand(8, *shape)
    # random weights: deep layers may fall silent (a collapse convert() would refuse); the
    # round trip is what is tested here
    snn, _ = snnconv.convert(model, [(x, torch.zeros(8, dtype=torch.long))], T=T, L=4,
                             calib_batches=1, per_channel=per_channel, bias_calibration=False,
                             maxpool="avg", reset=reset, progress=False, on_collapse="warn")
    return snn


# --- small hand-built graphs for the reader ---------------------------------------------------

def _neuron(nodes, edges, name, src, theta, shape=(4,)):
    theta = np.full(shape, theta, np.float32)
    nodes[name] = nir.I(r=np.ones(shape, np.float32),
                        metadata={"reset": "subtract", "v_init": 0.5, "compare": COMPARE})
    nodes[f"{name}_fire"] = nir.Threshold(spec_threshold(theta / np.float32(2)))
    nodes[f"{name}_reset"] = nir.Scale(-theta)
    edges += [(src, name), (name, f"{name}_fire"), (f"{name}_fire", f"{name}_reset"),
              (f"{name}_reset", name)]
    return f"{name}_fire"


def _tiny(theta=1.0, reset="subtract"):
    """input(3) -> fc1 -> neuron n1 -> fc2 -> output(2), as (nodes, edges)."""
    rng = np.random.default_rng(0)
    nodes = {"input": nir.Input(np.array([3])),
             "fc1": nir.Affine(weight=rng.standard_normal((4, 3)).astype(np.float32),
                               bias=np.zeros(4, np.float32)),
             "fc2": nir.Linear(weight=rng.standard_normal((2, 4)).astype(np.float32)),
             "output": nir.Output(np.array([2]))}
    edges = [("input", "fc1")]
    if reset == "subtract":
        spikes = _neuron(nodes, edges, "n1", "fc1", theta)
    else:
        nodes["n1"] = nir.IF(r=np.ones(4, np.float32), v_threshold=np.full(4, theta, np.float32),
                             v_reset=np.zeros(4, np.float32))
        edges.append(("fc1", "n1"))
        spikes = "n1"
    edges += [(spikes, "fc2"), ("fc2", "output")]
    return nodes, edges


def _graph(nodes, edges, **meta):
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=meta, type_check=False)


def test_parse_collapses_the_subtractive_neuron_pattern():
    p = parse(_graph(*_tiny(theta=0.75), T=6))
    assert [(o.name, o.kind, o.inputs) for o in p.ops] == [
        ("input", "input", ()), ("fc1", "affine", ("input",)), ("n1", "neuron", ("fc1",)),
        ("fc2", "linear", ("n1",)), ("output", "output", ("fc2",))]
    n1 = p.op("n1")
    assert n1.params["reset"] == "subtract" and n1.params["theta"].shape == ()
    assert float(n1.params["theta"]) == 0.75
    assert (p.reset, p.T, p.input_shape, p.output_shape) == ("subtract", 6, (3,), (2,))
    assert all(o.kind in KINDS for o in p.ops)


def test_parse_reads_a_plain_if_node_as_hard_reset_firing_above_the_threshold():
    p = parse(_graph(*_tiny(theta=2.0, reset="zero")))
    # NIR's IF fires on v > 2: the executors' ">=" threshold is the next float32 above 2
    theta = p.op("n1").params["theta"]
    assert p.reset == "zero" and theta == np.nextafter(np.float32(2), np.float32(3)) and p.T is None


@pytest.mark.parametrize("breakage, where", [
    ("unknown", "'n1'"), ("dangling", "'nowhere'"), ("cycle", "cycle"), ("no_output", "Output"),
    ("theta", "positive"), ("shape", "fc2"), ("mixed", "mixed reset"), ("duplicate", "twice"),
    ("half", r"theta \* \(1 - v_init\)"), ("no_meta", "metadata"),
])
def test_parse_refuses_bad_graphs_naming_the_node_or_edge(breakage, where):
    nodes, edges = _tiny()
    if breakage == "unknown":
        nodes["n1"] = nir.CubaLI(tau_syn=np.ones(4), tau_mem=np.ones(4), r=np.ones(4), v_leak=np.zeros(4))
    elif breakage == "dangling":
        edges.append(("fc2", "nowhere"))
    elif breakage == "cycle":
        edges.append(("fc2", "fc1"))
        nodes["fc2"] = nir.Linear(weight=np.ones((3, 4), np.float32))
        nodes["output"] = nir.Output(np.array([3]))
    elif breakage == "no_output":
        del nodes["output"]
        edges.remove(("fc2", "output"))
    elif breakage == "theta":
        nodes["n1_reset"] = nir.Scale(np.full(4, 0.5, np.float32))
    elif breakage == "shape":
        nodes["fc2"] = nir.Linear(weight=np.ones((2, 5), np.float32))
    elif breakage == "mixed":
        nodes["n2"] = nir.IF(r=np.ones(2, np.float32), v_threshold=np.ones(2, np.float32),
                             v_reset=np.zeros(2, np.float32))
        edges.remove(("fc2", "output"))
        edges += [("fc2", "n2"), ("n2", "output")]
    elif breakage == "duplicate":
        edges.append(("input", "fc1"))
    elif breakage == "half":
        nodes["n1_fire"] = nir.Threshold(np.full(4, 0.25, np.float32))
    elif breakage == "no_meta":
        nodes["n1"] = nir.I(r=np.ones(4, np.float32))
    with pytest.raises(NIRError, match=where):
        parse(_graph(nodes, edges))


def test_nir_error_is_an_snnconv_error():
    assert issubclass(NIRError, SnnconvError) and snnconv.NIRError is NIRError


# --- export --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet8", "small_cnn"])
def test_export_then_parse(name):
    snn = _convert(name)
    graph = export_nir(snn)
    assert graph.metadata == {"producer": "snnconv", "snnconv_format": 2, "T": 4, "reset": "subtract",
                              "encoding": "direct", "readout": "mean_over_T"}
    p = parse(graph)
    assert isinstance(p, ParsedGraph) and p.ops[0].kind == "input" and p.ops[-1].kind == "output"
    assert p.input_shape == (3, 16, 16) and p.output_shape == (10,)
    # one neuron op per IF module, with its threshold exactly
    thetas = snn.thresholds()
    assert {o.name for o in p.neurons} == {n.replace(".", "_") for n in thetas}
    for n, theta in thetas.items():
        assert np.array_equal(p.op(n.replace(".", "_")).params["theta"], theta.numpy())
    if name == "resnet8":
        # residual adds are several edges into the neuron after the add
        assert any(len(o.inputs) == 2 for o in p.neurons)
        # identity shortcuts carry an explicit Scale; the global pool is an adaptive AvgPool2d
        assert any(o.kind == "scale" for o in p.ops)
        assert any(o.kind == "avgpool2d" and o.params["adaptive"] for o in p.ops)


def test_export_refuses_a_layer_without_nir_form():
    snn = _convert("small_cnn", shape=(1, 8, 8))
    gm = snn.net
    fc = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc2")
    with gm.graph.inserting_after(fc):
        sig = gm.graph.call_function(torch.sigmoid, (fc,))
    fc.replace_all_uses_with(sig)
    sig.args = (fc,)
    gm.recompile()
    with pytest.raises(NIRError, match="sigmoid"):
        export_nir(snn)


def test_export_needs_an_input_shape():
    snn = _convert("small_cnn", shape=(1, 8, 8))
    snn.meta.pop("input_shape")
    with pytest.raises(NIRError, match="input_shape"):
        export_nir(snn)
    assert parse(export_nir(snn, input_shape=(1, 8, 8))).input_shape == (1, 8, 8)


# --- round trips: torch SNN -> file -> from_nir, bit for bit ---------------------------------

def _assert_same_run(a: SpikingNetwork, b: SpikingNetwork, x: torch.Tensor, T: int = 8) -> None:
    out_a, spk_a = run_with_spikes(a, x, T)
    out_b, spk_b = run_with_spikes(b, x, T)
    assert out_a.shape == (T, x.shape[0], *out_a.shape[2:])
    assert torch.equal(out_a, out_b), f"readouts differ by {(out_a - out_b).abs().max().item()}"
    assert spk_a.keys() == spk_b.keys() and spk_a
    for name in spk_a:
        assert torch.equal(spk_a[name], spk_b[name]), f"spikes of {name} differ"
    assert sum(float(s.sum()) for s in spk_a.values()) > 0  # the comparison is not vacuous


def _through_file(snn: SpikingNetwork, tmp_path, T: int = 8) -> SpikingNetwork:
    path = tmp_path / "net.nir"
    save_nir(export_nir(snn), path)
    return from_nir(load_nir(path), T=T)


_ZOO_SHAPES = {"vgg11": (1, 32, 32), "vgg16": (1, 32, 32)}  # five 2x2 pools need 32x32


@pytest.mark.parametrize("reset", ["subtract", "zero"])
@pytest.mark.parametrize("name", models.names())
def test_zoo_round_trip_is_bit_identical(name, reset, tmp_path):
    shape = _ZOO_SHAPES.get(name, (3, 16, 16))
    snn = _convert(name, shape, reset=reset)
    back = _through_file(snn, tmp_path)
    assert back.meta["reset"] == reset
    _assert_same_run(snn, back, torch.rand(4, *shape))


@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_per_channel_thresholds_round_trip(reset, tmp_path):
    snn = _convert("resnet8", per_channel=True, reset=reset)
    assert any(t.dim() == 1 for t in snn.thresholds().values())
    back = _through_file(snn, tmp_path)
    for name, theta in snn.thresholds().items():
        got = back.thresholds()[name]
        assert got.shape == theta.shape and torch.equal(got, theta)  # theta = -Scale exactly
    _assert_same_run(snn, back, torch.rand(4, 3, 16, 16))


def test_fine_tuned_perturbed_digits_network_round_trips(small_digits_snn, digits_data, tmp_path):
    """Fine-tuned (trained thresholds), then per-channel thresholds and shifted biases."""
    from torch.utils.data import DataLoader

    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    cfg = snnconv.FinetuneConfig(epochs=1, T=4, max_steps_per_epoch=3, train_thresholds=True,
                                 val_fraction=0.0, amp=False)
    tuned, _ = snnconv.finetune(small_digits_snn, loader, config=cfg, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in tuned.net.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)) and mod.bias is not None:
                mod.bias += 0.05 * torch.randn(mod.bias.shape, generator=g)
    # the first neuron (after conv1) gets per-channel thresholds
    first = next(iter(neurons(tuned.net).values()))
    width = next(m for m in tuned.net.modules() if isinstance(m, nn.Conv2d)).out_channels
    first.theta = nn.Parameter(first.theta.detach() * (0.5 + torch.rand(width, generator=g)),
                               requires_grad=False)
    tuned.meta["input_shape"] = [1, 8, 8]
    back = _through_file(tuned, tmp_path)
    x = torch.stack([test_set[i][0] for i in range(4)])
    _assert_same_run(tuned, back, x)
    _assert_same_run(tuned, back, torch.rand(4, 1, 8, 8))


def test_from_nir_builds_a_network_like_convert(small_digits_snn, digits_data, tmp_path):
    snn = small_digits_snn
    snn.meta["input_shape"] = [1, 8, 8]
    graph = export_nir(snn)
    back = from_nir(graph)
    assert back.T == 4 and isinstance(back, SpikingNetwork)  # T from the graph's metadata
    kinds = {type(m) for m in back.net.children()}
    assert kinds <= {nn.Conv2d, nn.Linear, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, Scale,
                     IFNeuron, TimeExpand}
    assert sum(isinstance(m, TimeExpand) for m in back.net.modules()) == 1
    assert sorted(neurons(back.net)) == sorted(neurons(snn.net))
    # saves and loads as a SpikingNetwork, and exports again to the same graph
    back.save(tmp_path / "net.pt")
    again = SpikingNetwork.load(tmp_path / "net.pt")
    _assert_same_run(snn, again, torch.rand(4, 1, 8, 8), T=4)
    graph2 = export_nir(again)
    assert list(graph2.edges) == list(graph.edges) and graph2.nodes.keys() == graph.nodes.keys()
    for k, node in graph.nodes.items():
        for field in ("weight", "bias", "scale", "threshold", "r", "kernel_size"):
            if hasattr(node, field):
                assert np.array_equal(getattr(node, field), getattr(graph2.nodes[k], field)), (k, field)
    # and fine-tunes: a few BPTT steps move its weights
    from torch.utils.data import DataLoader

    loader = DataLoader(digits_data[0], batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    cfg = snnconv.FinetuneConfig(epochs=1, T=4, max_steps_per_epoch=2, val_fraction=0.0, amp=False)
    tuned, _ = snnconv.finetune(back, loader, config=cfg, progress=False)
    before, after = back.state_dict(), tuned.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


# --- files ---------------------------------------------------------------------------------------

def test_save_nir_is_atomic(tmp_path):
    path = tmp_path / "net.nir"
    good = _graph(*_tiny())
    save_nir(good, path)
    nodes, edges = _tiny()
    edges.append(("fc2", "nowhere"))
    with pytest.raises(NIRError):
        save_nir(_graph(nodes, edges), path)
    assert os.listdir(tmp_path) == ["net.nir"]  # no temporary file left behind
    assert parse(load_nir(path)).op("n1").kind == "neuron"  # the old file is intact


@pytest.mark.parametrize("damage", ["missing", "truncated", "text", "hdf5", "unread", "type"])
def test_load_nir_refuses_bad_files(damage, tmp_path):
    path = tmp_path / "net.nir"
    save_nir(_graph(*_tiny()), path)
    if damage == "missing":
        path = tmp_path / "absent.nir"
    elif damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "text":
        path.write_text("not a NIR file\n")
    elif damage == "hdf5":
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=np.arange(3))
    elif damage in ("unread", "type"):
        with h5py.File(path, "a") as f:
            del f["node/nodes/n1"]
            g = f.create_group("node/nodes/n1")
            g.create_dataset("type", data="CubaLI" if damage == "unread" else "os.system",
                             dtype=h5py.string_dtype())
    with pytest.raises(NIRError, match="absent|truncated|HDF5|NIR|'n1'"):
        load_nir(path)


# --- an independent consumer: spikingjelly 2.0's NIR importer --------------------------------

@pytest.mark.parametrize("name, shape", [("small_cnn", (1, 8, 8)), ("vgg11", (1, 32, 32))])
def test_spikingjelly_reads_our_hard_reset_file_with_the_same_meaning(name, shape, digits_data, tmp_path):
    snn = _convert(name, shape, reset="zero")
    path = tmp_path / "hard.nir"
    save_nir(export_nir(snn), path)
    inputs = [torch.rand(4, *shape)]
    if shape == (1, 8, 8):
        inputs.append(torch.stack([digits_data[1][i][0] for i in range(4)]))
    for x in inputs:
        ours, our_spikes = run_with_spikes(snn, x, T=8)
        theirs, their_spikes = spikingjelly_run(path, x, 8, list(our_spikes))
        for layer, s in our_spikes.items():
            assert torch.equal(s, their_spikes[layer]), f"spikes of {layer} differ"
        # the readout may differ by float rounding only (spikingjelly pools with AvgPool2d where
        # the network has AdaptiveAvgPool2d); the spikes above are identical
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_spikingjelly_refuses_our_subtractive_file(tmp_path):
    """A reset-to-zero reader cannot mistake the subtractive encoding for its own IF."""
    from spikingjelly.activation_based.nir_exchange import import_from_nir

    path = tmp_path / "soft.nir"
    save_nir(export_nir(_convert("small_cnn", (1, 8, 8))), path)
    with pytest.raises(ValueError, match="Unknown node type.*neuron.I"):
        import_from_nir(str(path), dt=1.0)
    with pytest.raises(NotImplementedError, match="Recurrent"):
        import_from_nir(str(path), dt=1.0, step_mode="m")


def test_spikingjelly_refuses_per_channel_hard_reset_thresholds(tmp_path):
    path = tmp_path / "hard_pc.nir"
    save_nir(export_nir(_convert("small_cnn", (1, 8, 8), per_channel=True, reset="zero")), path)
    from spikingjelly.activation_based.nir_exchange import import_from_nir

    with pytest.raises(ValueError, match="uniform"):
        import_from_nir(str(path), dt=1.0)
    assert parse(load_nir(path)).reset == "zero"  # while snnconv reads it exactly


class _Sums(nn.Module):
    """Adds nested on the right, ``a + (b + c)``, and an add read by two layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.b, self.c, self.d = (nn.Conv2d(4, 4, 3, padding=1) for _ in range(3))
        self.e = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        y = self.b(x) + (self.c(x) + self.d(x))  # the right-hand sum must be summed first
        z = torch.relu(y)
        return self.fc(torch.flatten(torch.relu(self.e(z) + y), 1))


def test_nested_sums_keep_their_rounding(tmp_path):
    torch.manual_seed(0)
    x = torch.rand(8, 1, 8, 8)
    snn, _ = snnconv.convert(_Sums(), [(x, torch.zeros(8, dtype=torch.long))], T=4, L=4,
                             calib_batches=1, bias_calibration=False, progress=False)
    p = parse(export_nir(snn))
    sums = [o for o in p.ops if o.kind == "sum"]
    assert sums, "a + (b + c) needs its own sum node"
    _assert_same_run(snn, _through_file(snn, tmp_path), torch.rand(4, 1, 8, 8))


def test_identity_fan_in_is_a_sum():
    nodes, edges = _tiny()
    nodes["skip"] = nir.Affine(weight=np.ones((4, 3), np.float32), bias=np.zeros(4, np.float32))
    nodes["join"] = nir.ir.graph.Identity(input_type={"input": np.array([4])})
    edges.remove(("n1_fire", "fc2"))
    edges += [("input", "skip"), ("n1_fire", "join"), ("skip", "join"), ("join", "fc2")]
    join = parse(_graph(nodes, edges)).op("join")
    assert join.kind == "sum" and join.inputs == ("n1", "skip") and join.out_shape == (4,)
