"""NIR export, the strict reader (snnconv_backends.nirgraph.parse), files and round trips."""

from __future__ import annotations

import nir
import numpy as np
import pytest
import torch

import snnconv
from snnconv import models
from snnconv.errors import NIRError, SnnconvError
from snnconv.nir_io import export_nir
from snnconv_backends.nirgraph import KINDS, ParsedGraph, parse


def _convert(name: str, shape=(3, 16, 16), *, per_channel=False, T=4, seed=0, **kw):
    """A zoo network converted on random data (a cheap, real conversion)."""
    torch.manual_seed(seed)
    model = models.get(name, in_channels=shape[0], num_classes=10, **kw)
    x = torch.rand(8, *shape)
    snn, _ = snnconv.convert(model, [(x, torch.zeros(8, dtype=torch.long))], T=T, L=4,
                             calib_batches=1, per_channel=per_channel, bias_calibration=False,
                             maxpool="avg", progress=False)
    return snn


# --- small hand-built graphs for the reader ---------------------------------------------------

def _neuron(nodes, edges, name, src, theta, shape=(4,)):
    theta = np.full(shape, theta, np.float32)
    nodes[name] = nir.I(r=np.ones(shape, np.float32),
                        metadata={"reset": "subtract", "v_init": 0.5, "compare": ">="})
    nodes[f"{name}_fire"] = nir.Threshold(theta / np.float32(2))
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


def test_parse_reads_a_plain_if_node_as_hard_reset():
    p = parse(_graph(*_tiny(theta=2.0, reset="zero")))
    assert p.reset == "zero" and float(p.op("n1").params["theta"]) == 2.0 and p.T is None


@pytest.mark.parametrize("breakage, where", [
    ("unknown", "'n1'"), ("dangling", "'nowhere'"), ("cycle", "cycle"), ("no_output", "Output"),
    ("theta", "positive"), ("shape", "fc2"), ("mixed", "mixed reset"), ("duplicate", "twice"),
    ("half", "theta/2"), ("no_meta", "metadata"),
])
def test_parse_refuses_bad_graphs_naming_the_node_or_edge(breakage, where):
    nodes, edges = _tiny()
    if breakage == "unknown":
        nodes["n1"] = nir.LIF(tau=np.ones(4), r=np.ones(4), v_leak=np.zeros(4), v_threshold=np.ones(4))
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
    assert graph.metadata == {"producer": "snnconv", "snnconv_format": 1, "T": 4, "reset": "subtract",
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
    snn = _convert("small_cnn", shape=(1, 8, 8), width=4)
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
    snn = _convert("small_cnn", shape=(1, 8, 8), width=4)
    snn.meta.pop("input_shape")
    with pytest.raises(NIRError, match="input_shape"):
        export_nir(snn)
    assert parse(export_nir(snn, input_shape=(1, 8, 8))).input_shape == (1, 8, 8)
