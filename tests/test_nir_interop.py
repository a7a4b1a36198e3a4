"""What a NIR node means on every path: NIR's spec unless snnconv's metadata says otherwise
(comparison, reset, time step, files older than v_reset), node names as data, sequence inputs,
and files that another reader (spikingjelly) runs with the same spikes."""

from __future__ import annotations

import h5py
import nir
import numpy as np
import pytest
import torch
from _probes import run_with_spikes, spikingjelly_run
from test_nir import _convert

from snnconv import backends
from snnconv.errors import BackendError, DataError, NIRError
from snnconv.nir.format import COMPARE, FORMAT_VERSION, engine_threshold, predates_v_reset, spec_threshold
from snnconv.nir.reader import parse
from snnconv.snn.nir_io import export_nir, from_nir, load_nir, save_nir
from snnconv_backends.gpu import GPUBackend

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


#: the metadata snnconv writes on a hard-reset IF
_HARD = {"snnconv_neuron": "if", "reset": "zero", "v_init": 0.0, "compare": COMPARE}
#: NIR's threshold of snnconv's theta = 1 (one float32 step below it)
_SPEC_ONE = float(spec_threshold(np.float32(1.0)))


def _if_chain(theta=1.0, *, r=1.0, weight=1.0, metadata=None, names=("input", "fc", "n", "out", "output")):
    """input(1) -> fc (weight) -> IF(r, theta) -> readout (1) -> output: the readout is the spike."""
    i, fc, n, out, o = names
    nodes = {i: nir.Input(np.array([1])),
             fc: nir.Affine(weight=np.full((1, 1), weight, np.float32), bias=np.zeros(1, np.float32)),
             n: nir.IF(r=np.full(1, r, np.float32), v_threshold=np.full(1, theta, np.float32),
                       v_reset=np.zeros(1, np.float32), metadata=metadata or {}),
             out: nir.Linear(weight=np.ones((1, 1), np.float32)),
             o: nir.Output(np.array([1]))}
    edges = [(i, fc), (fc, n), (n, out), (out, o)]
    return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)


def _spikes_everywhere(graph, x, T, *, dt=1.0, loihi=True):
    """The per-step readout of ``graph`` on every executor that runs here, by name."""
    runs = {"from_nir": from_nir(graph, T=T, dt=dt).run(x)}
    runs["cpu"] = backends.get("cpu").compile(graph, dt=dt).run(x, T).outputs
    # the gpu backend's code path on the cpu device (CUDA itself: tests/test_nir_cuda.py)
    runs["gpu(cpu device)"] = GPUBackend().compile(graph, dt=dt, device="cpu").run(x, T).outputs
    if torch.cuda.is_available():
        runs["gpu"] = backends.get("gpu").compile(graph, dt=dt).run(x, T).outputs.cpu()
    if loihi:  # its fixed-point readout of a spike is within 1% of 1: the spike is > 1/2
        out = backends.get("loihi2-sim").compile(graph, dt=dt).run(x, T).outputs
        runs["loihi2-sim"] = (out > 0.5).to(torch.float32)
    return {k: v.reshape(T, -1) for k, v in runs.items()}


# --- the comparison --------------------------------------------------------------------------

def test_the_spec_example_fires_above_the_threshold_on_every_executor():
    """nir.IF(r=1, v_threshold=1) fed 0.5 per step: v = 0.5, 1.0 (not above 1), 1.5 (fires)..."""
    graph = _if_chain(1.0, weight=0.5)
    runs = _spikes_everywhere(graph, torch.ones(1, 1), 4)
    try:  # Intel's Lava itself, where its side environment exists (make lava-env)
        lava = backends.get("lava")
    except BackendError:
        lava = None
    if lava is not None:
        runs["lava"] = (lava.compile(graph).run(torch.ones(1, 1), 4).outputs > 0.5).to(torch.float32)
    for name, out in runs.items():
        assert out.reshape(-1).tolist() == [0, 0, 1, 0], name


def test_a_file_of_another_snnconv_format_is_refused_by_name():
    """snnconv_format 1 (thresholds compared with '>=') is refused on every path, saying which
    format was found, which is read and what to do."""
    graph = _if_chain(_SPEC_ONE, metadata=_HARD)
    graph.metadata.update({"producer": "snnconv", "snnconv_format": 1, "T": 4, "reset": "zero"})
    refusal = r"snnconv_format=1: this snnconv reads format 2 only\. Re-export"
    with pytest.raises(NIRError, match=refusal):
        parse(graph)
    with pytest.raises(NIRError, match=refusal):
        from_nir(graph)
    with pytest.raises(BackendError, match=refusal):
        backends.get("cpu").compile(graph)
    graph.metadata["snnconv_format"] = FORMAT_VERSION
    assert parse(graph).op("n").params["theta"] == np.float32(1.0) and from_nir(graph).T == 4


@pytest.mark.parametrize("stated", ["<", ">="])
def test_a_comparison_other_than_the_spec_s_is_refused_where_a_node_states_it(stated):
    with pytest.raises(NIRError, match=f"compare='{stated}', but snnconv reads this node only with compare='>'"):
        parse(_if_chain(metadata={"compare": stated}))


def test_the_written_threshold_makes_above_mean_at_or_above_for_every_float32():
    rng = np.random.default_rng(0)
    theta = np.concatenate([rng.uniform(1e-3, 1e3, 2000), [1.0, 0.5, 2.0, 0.1, 3.0]]).astype(np.float32)
    written = spec_threshold(theta)
    assert np.array_equal(engine_threshold(written, ">"), theta)  # read back exactly
    for v in (theta, np.nextafter(theta, np.float32(0)), np.nextafter(theta, np.float32(np.inf)),
              theta * np.float32(0.5) + theta * np.float32(0.5)):
        v = v.astype(np.float32)
        assert np.array_equal(v > written, v >= theta)


@pytest.mark.parametrize("reset", ["zero", "subtract"])
def test_our_files_state_the_spec_comparison_and_read_back_exactly(reset):
    snn = _convert("small_cnn", (1, 8, 8), reset=reset)
    graph = export_nir(snn)
    assert graph.metadata["snnconv_format"] == FORMAT_VERSION == 2
    thetas = snn.thresholds()
    for name, theta in thetas.items():
        node = graph.nodes[name.replace(".", "_")]
        assert node.metadata["compare"] == COMPARE == ">"
        if reset == "zero":  # the IF's threshold is one float32 step below theta
            full = np.full(node.v_threshold.shape, theta.numpy())
            assert np.array_equal(node.v_threshold, spec_threshold(full))
        assert np.array_equal(parse(graph).op(name.replace(".", "_")).params["theta"], theta.numpy())


def test_hard_reset_ties_agree_between_our_network_and_a_spec_reader():
    """A hard-reset network whose membranes reach theta exactly (dyadic weights): the torch
    network (fires on >= theta), the backends reading the file, and NIR's own '>' rule applied
    to the written threshold all give the same spikes. (loihi2-sim compares its integer
    membrane with '>' as Lava's LIF does: an exact tie of theta fires there one step later,
    within its documented fixed-point error.)"""
    snn = from_nir(_if_chain(_SPEC_ONE, weight=0.25, metadata=_HARD), T=8)  # v = 0.25, ... 1.0 ties
    x = torch.ones(3, 1)
    ours = snn.run(x)
    assert ours.sum() > 0  # it fires, at exact ties (4th step)
    graph = export_nir(snn)
    assert graph.nodes["n"].v_threshold[0] < 1.0
    for name, out in _spikes_everywhere(graph, x, 8, loihi=False).items():
        assert torch.equal(out, ours.reshape(8, -1)), name
    v, spec = 0.0, []
    for _ in range(8):  # the spec, by hand: v += 0.25; fire on v > v_threshold; reset to 0
        v += 0.25
        fired = np.float32(v) > graph.nodes["n"].v_threshold[0]
        spec.append(float(fired))
        v = 0.0 if fired else v
    assert ours[:, 0, 0].tolist() == spec


# --- the time step -----------------------------------------------------------------------------

def test_dt_is_a_parameter_of_reading():
    """spikingjelly's default export: IF(r = 1/dt = 1e4)."""
    graph = _if_chain(1.0, r=1e4, weight=0.5)
    with pytest.raises(NIRError, match=r"r \* dt.*dt=0.0001"):
        parse(graph)
    with pytest.raises(Exception, match=r"r \* dt"):
        backends.get("cpu").compile(graph)
    for name, out in _spikes_everywhere(graph, torch.ones(1, 1), 4, dt=1e-4).items():
        assert out.reshape(-1).tolist() == [0, 0, 1, 0], name
    with pytest.raises(NIRError, match="dt must be a positive"):
        parse(graph, dt=0)


def test_run_command_takes_dt(tmp_path, digits_data, capsys):
    from snnconv.cli import main

    rng = np.random.default_rng(0)
    nodes = {"input": nir.Input(np.array([1, 8, 8])),
             "flat": nir.Flatten(input_type={"input": np.array([1, 8, 8])}, start_dim=0, end_dim=-1),
             "fc": nir.Affine(weight=rng.standard_normal((16, 64)).astype(np.float32) / 4,
                              bias=np.zeros(16, np.float32)),
             "n": nir.IF(r=np.full(16, 1e4, np.float32), v_threshold=np.ones(16, np.float32),
                         v_reset=np.zeros(16, np.float32)),
             "out": nir.Linear(weight=rng.standard_normal((10, 16)).astype(np.float32)),
             "output": nir.Output(np.array([10]))}
    graph = nir.NIRGraph(nodes=nodes, edges=[("input", "flat"), ("flat", "fc"), ("fc", "n"), ("n", "out"),
                                             ("out", "output")], type_check=False)
    path = tmp_path / "sj.nir"
    nir.write(path, graph)
    with pytest.raises(NIRError, match=r"r \* dt"):
        load_nir(path)
    argv = ["run", str(path), "--data", "digits", "--T", "4", "--limit", "40"]
    assert main(argv) == 2 and "r * dt" in capsys.readouterr().err
    assert main(argv + ["--dt", "1e-4"]) == 0
    from snnconv.data import stratified_subset

    x, y = (t[stratified_subset(digits_data[1], 40).indices] for t in digits_data[1].tensors)  # --limit's
    r = backends.get("cpu").compile(load_nir(path, dt=1e-4), dt=1e-4).run(x, 4)
    acc = 100 * float((r.outputs.mean(0).argmax(1) == y).float().mean())
    assert f"accuracy (mean readout over T=4): {acc:.2f}%" in capsys.readouterr().out


# --- files older than v_reset -----------------------------------------------------------------

def _as_old_file(path, version="0.2.0"):
    """Rewrite a NIR file as nir <= 1.0.5 wrote it: its version, IF without v_reset."""
    with h5py.File(path, "r+") as f:
        del f["version"]
        f.create_dataset("version", data=version, dtype=h5py.string_dtype())
        for node in f["node"]["nodes"].values():
            if node["type"][()] == b"IF" and "v_reset" in node:
                del node["v_reset"]


@pytest.mark.parametrize("version, refused", [("0.2.0", True), ("1.0.5", True), ("1.0.6", False),
                                              ("1.0.8", False)])
def test_an_if_of_a_file_older_than_v_reset_is_refused_with_the_reason(version, refused, tmp_path):
    path = tmp_path / "old.nir"
    nir.write(path, _if_chain(1.0))
    _as_old_file(path, version)
    assert predates_v_reset(version) is refused
    if refused:
        with pytest.raises(NIRError, match=f"nir {version}.*subtraction"):
            load_nir(path)
    else:
        assert parse(load_nir(path)).reset == "zero"


def test_predates_v_reset_reads_version_strings():
    assert predates_v_reset("1.0.4") and predates_v_reset(b"0.2.0") and not predates_v_reset("1.0.8")
    assert predates_v_reset(None) is None and predates_v_reset("dev") is None


# --- names and ranks ---------------------------------------------------------------------------

def test_node_names_are_data_not_code():
    graph = _if_chain(1.0, weight=0.5, names=("input", "if", "class", "lambda", "output"))
    x = torch.ones(2, 1)
    ours = from_nir(graph, T=4).run(x)
    assert torch.equal(ours, backends.get("cpu").compile(graph).run(x, 4).outputs)
    for awkward in ("0", "forward", "training", "a.b", "T"):
        g = _if_chain(1.0, weight=0.5, names=("input", awkward, "n", "out", "output"))
        assert torch.equal(from_nir(g, T=4).run(x), ours)


def test_a_sequence_is_honoured_by_the_backend_and_refused_by_rank_by_the_network():
    graph = _if_chain(1.0, weight=1.0)
    T = 4
    seq = torch.tensor([[[0.5]], [[0.5]], [[0.0]], [[1.5]]])  # [T, B=1, N=1]
    out = backends.get("cpu").compile(graph).run(seq, T).outputs
    assert out.reshape(-1).tolist() == [0, 0, 0, 1]  # 0.5, 1.0 (not above), 1.0, 2.5 fires
    snn = from_nir(graph, T=T)
    with pytest.raises(DataError, match=r"static batch \[B, 1\].*\(4, 1, 1\)"):
        snn(seq)
    with pytest.raises(DataError, match="rank|static batch"):
        snn.run(seq)


# --- a file spikingjelly runs: a hard-reset ResNet with identity shortcuts -----------------

def test_spikingjelly_runs_our_hard_reset_resnet_with_identity_shortcuts(tmp_path):
    snn = _convert("resnet8", (3, 16, 16), reset="zero")
    graph = export_nir(snn)
    marked = [n for n, node in graph.nodes.items() if (node.metadata or {}).get("snnconv_op") == "scale"]
    assert marked and not any(isinstance(node, nir.Scale) for node in graph.nodes.values())
    assert [o.kind for o in parse(graph).ops].count("scale") == len(marked)  # read back as scales
    path = tmp_path / "resnet.nir"
    save_nir(graph, path)
    x = torch.rand(3, 3, 16, 16)
    ours, our_spikes = run_with_spikes(snn, x, T=8)
    names = {n: n.replace(".", "_") for n in our_spikes}
    theirs, their_spikes = spikingjelly_run(path, x, 8, list(names.values()))
    assert sum(int(s.sum()) for s in our_spikes.values()) > 0
    for layer, s in our_spikes.items():
        assert torch.equal(s, their_spikes[names[layer]]), f"spikes of {layer} differ"
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    again = from_nir(load_nir(path))
    assert torch.equal(again.run(x, T=8), ours)


def test_a_reader_option_reproduces_a_producer_that_fires_on_equality():
    """spikingjelly and sinabs simulate v >= v_threshold against their files' NIR meaning."""
    graph = _if_chain(1.0, weight=0.5)
    x = torch.ones(1, 1)
    assert from_nir(graph, T=4, compare=">=").run(x).reshape(-1).tolist() == [0, 1, 0, 1]
    cpu = backends.get("cpu").compile(graph, compare=">=")
    assert cpu.run(x, 4).outputs.reshape(-1).tolist() == [0, 1, 0, 1]
    stated = _if_chain(1.0, weight=0.5, metadata={"compare": ">"})  # what a node states wins
    assert from_nir(stated, T=4, compare=">=").run(x).reshape(-1).tolist() == [0, 0, 1, 0]
    with pytest.raises(NIRError, match="compare must be"):
        parse(graph, compare="=>")


# --- every NIR 1.0.8 node type: read, written or refused -------------------------------------

def _hard_if(shape, theta=1.0):
    return nir.IF(r=np.ones(shape, np.float32), v_threshold=spec_threshold(np.full(shape, theta, np.float32)),
                  v_reset=np.zeros(shape, np.float32), metadata=_HARD)


def test_conv1d_and_sum_pooling_are_read_and_written_exactly():
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((4, 2, 3)).astype(np.float32)
    w2 = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    graphs = {
        "conv1d": ({"input": nir.Input(np.array([2, 10])),
                    "c": nir.Conv1d(input_shape=10, weight=w1, stride=1, padding=1, dilation=1, groups=1,
                                    bias=np.zeros(4, np.float32)),
                    "n": _hard_if((4, 10)), "f": nir.Flatten(input_type={"input": np.array([4, 10])},
                                                             start_dim=0, end_dim=-1),
                    "o": nir.Linear(weight=rng.standard_normal((3, 40)).astype(np.float32)),
                    "output": nir.Output(np.array([3]))},
                   [("input", "c"), ("c", "n"), ("n", "f"), ("f", "o"), ("o", "output")], (2, 10)),
        "sumpool2d": ({"input": nir.Input(np.array([2, 6, 6])),
                       "c": nir.Conv2d(input_shape=(6, 6), weight=w2, stride=1, padding=1, dilation=1,
                                       groups=1, bias=np.zeros(4, np.float32)),
                       "n": _hard_if((4, 6, 6)),
                       "p": nir.SumPool2d(kernel_size=np.array([2, 2]), stride=np.array([2, 2]),
                                          padding=np.array([0, 0])),
                       "output": nir.Output(np.array([4, 3, 3]))},
                      [("input", "c"), ("c", "n"), ("n", "p"), ("p", "output")], (2, 6, 6)),
    }
    for kind, (nodes, edges, shape) in graphs.items():
        graph = nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)
        x = torch.rand(3, *shape) * 2
        snn = from_nir(graph, T=4)
        again = export_nir(snn)
        assert [o.kind for o in parse(again).ops] == [o.kind for o in parse(graph).ops]
        assert kind in {o.kind for o in parse(again).ops}
        ours = snn.run(x)
        assert ours.abs().sum() > 0
        assert torch.equal(from_nir(again).run(x), ours)
        assert torch.equal(backends.get("cpu").compile(again).run(x, 4).outputs, ours)


@pytest.mark.parametrize("node, match", [
    (nir.Delay(delay=np.ones(4, np.float32)), "type Delay"),
    (nir.CubaLI(tau_syn=np.ones(4, np.float32), tau_mem=np.ones(4, np.float32), r=np.ones(4, np.float32),
                v_leak=np.zeros(4, np.float32)), "type CubaLI,"),
    (nir.Threshold(np.ones(4, np.float32)), "Threshold outside"),
    (nir.I(r=np.ones(4, np.float32)), "an I node must feed exactly one Threshold"),
    (nir.NIRGraph(nodes={"i": nir.Input(np.array([4])), "o": nir.Output(np.array([4]))},
                  edges=[("i", "o")], type_check=False), "is a nested NIRGraph"),
])
def test_node_types_without_an_exact_meaning_are_refused_by_name(node, match):
    nodes = {"input": nir.Input(np.array([4])), "x": node, "output": nir.Output(np.array([4]))}
    graph = nir.NIRGraph(nodes=nodes, edges=[("input", "x"), ("x", "output")], type_check=False)
    with pytest.raises(NIRError, match=f"node 'x'.*{match}"):
        parse(graph)
