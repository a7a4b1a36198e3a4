"""A network file is data: an attacker who edits its graph and recomputes the (public) digest
cannot make any reader run code. Each attack writes a marker file if its code runs."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.cli import main
from snnconv.constructs.prefix import analog_prefix
from snnconv.errors import CheckpointError, NIRError, UnsupportedModelError
from snnconv.io.digest import content_digest
from snnconv.nir.format import PREFIX_FILE_KEY, PREFIX_SHA256_KEY
from snnconv.snn.graphfile import check_graph, graph_from_dict
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.prefixfile import load_prefix, save_prefix

MARKER = "pwned"  # relative (the tests run in tmp_path): no dot, no slash in the payloads
RUN = f"getattr(__import__('os'),'system')('touch {MARKER}')"


class _Stem(nn.Module):
    """Conv, ReLU, max-pooling (an analog prefix), then a spiking conv and a readout."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.maxpool = nn.MaxPool2d(2)
        self.a = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.maxpool(F.relu(self.conv1(x)))
        y = F.relu(self.a(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y + y, 1), 1))


@pytest.fixture(scope="module")
def network():
    torch.manual_seed(0)
    x = torch.rand(16, 1, 8, 8)
    snn, _ = snnconv.convert(_Stem().eval(), [(x, torch.zeros(16, dtype=torch.long))], T=2,
                             finetune_epochs=0, reconstruction_steps=0, progress=False,
                             on_collapse="warn")
    assert analog_prefix(snn) is not None
    return snn, x


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _forge(payload: dict) -> dict:
    payload["digest"] = content_digest({k: v for k, v in payload.items() if k != "digest"})
    return payload


def _nodes(graph: dict, op: str) -> list[dict]:
    return [n for n in graph["nodes"] if n["op"] == op]


def _prefix_graph(graph: dict) -> dict:
    return next(m["graph"] for m in graph["modules"].values() if m["type"] == "AnalogPrefix")


def _rename_module(graph: dict, old: str, new: str) -> None:
    graph["modules"] = {new if k == old else k: v for k, v in graph["modules"].items()}
    for n in _nodes(graph, "call_module"):
        if n["target"] == old:
            n["target"] = new


def _attack(graph: dict, how: str) -> None:
    """Edit ``graph`` (graph_to_dict's output) the way an attacker who read the source would."""
    if how == "placeholder target":
        _nodes(graph, "placeholder")[0]["target"] = f"x, __z={RUN}"
    elif how == "placeholder default":
        _nodes(graph, "placeholder")[0]["args"] = {"tuple": [{"node": "nowhere"}]}
    elif how == "keyword name":
        node = next(n for n in graph["nodes"] if n["op"] in ("call_function", "call_module"))
        node["kwargs"] = {"dict": {f"__z={RUN}, dim": 1}}
    elif how == "module target":
        old = _nodes(graph, "call_module")[-1]["target"]
        _rename_module(graph, old, f'fc"){RUN}+getattr(self,"fc')
    elif how == "module target dunder":
        old = _nodes(graph, "call_module")[-1]["target"]
        _rename_module(graph, old, "__class__")
    elif how == "node name":
        node = _nodes(graph, "call_module")[0]
        for n in graph["nodes"]:
            if n is not node:
                n["args"] = _replace_ref(n["args"], node["name"], f"a;{RUN}")
        node["name"] = f"a;{RUN}"
    elif how == "prefix placeholder target":
        _nodes(_prefix_graph(graph), "placeholder")[0]["target"] = f"x, __z={RUN}"
    elif how == "prefix keyword name":
        node = _nodes(_prefix_graph(graph), "call_module")[0]
        node["kwargs"] = {"dict": {f"__z={RUN}, inplace": 1}}
    elif how == "getattr of a method":
        node = next(n for n in graph["nodes"] if n["op"] == "call_function")
        node.update(target="builtins.getattr", args={"tuple": [node["args"]["tuple"][0], "__class__"]})
    elif how == "two inputs":
        graph["nodes"].insert(1, {"op": "placeholder", "name": "y", "target": "y",
                                  "args": {"tuple": []}, "kwargs": {"dict": {}}})
    elif how == "no output":
        graph["nodes"] = [n for n in graph["nodes"] if n["op"] != "output"]
    elif how == "forward reference":
        node = _nodes(graph, "call_module")[0]
        node["args"] = {"tuple": [{"node": graph["nodes"][-2]["name"]}]}
    else:
        raise AssertionError(how)


def _replace_ref(a, old: str, new: str):
    if isinstance(a, dict):
        if a.get("node") == old:
            return {"node": new}
        return {k: _replace_ref(v, old, new) for k, v in a.items()}
    if isinstance(a, list):
        return [_replace_ref(v, old, new) for v in a]
    return a


def _forged_file(snn: SpikingNetwork, how: str) -> dict:
    """``evil.pt``: ``snn``'s file with the attack ``how`` in its graph and its digest recomputed."""
    snn.save("snn.pt")
    payload = torch.load("snn.pt", weights_only=True)
    _attack(payload["graph"], how)
    torch.save(_forge(payload), "evil.pt")
    return payload


ATTACKS = ["placeholder target", "placeholder default", "keyword name", "module target",
           "module target dunder", "node name", "prefix placeholder target", "prefix keyword name",
           "getattr of a method", "two inputs", "no output", "forward reference"]


@pytest.mark.parametrize("how", ATTACKS)
def test_a_forged_network_file_runs_no_code_and_is_refused(network, tmp_path, how):
    snn, x = network
    payload = _forged_file(snn, how)
    with pytest.raises(CheckpointError, match="refused|malformed"):
        SpikingNetwork.load("evil.pt")(x)  # load, then what a user does next
    assert not (tmp_path / MARKER).exists()
    with pytest.raises(CheckpointError):
        graph_from_dict(payload["graph"])  # the in-memory reader is the same schema
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("how", ["placeholder target", "keyword name", "module target"])
def test_the_cli_export_of_a_forged_file_runs_no_code(network, tmp_path, how):
    _forged_file(network[0], how)
    assert main(["export", "evil.pt", "evil.nir", "--quiet"]) == 2
    assert not (tmp_path / MARKER).exists()
    assert not (tmp_path / "evil.nir").exists()


@pytest.mark.parametrize("how", ["placeholder target", "keyword name", "prefix keyword name"])
def test_a_forged_prefix_file_with_its_sha256_updated_runs_no_code(network, tmp_path, how):
    """The prefix file of an exported network, replaced, with the NIR metadata's SHA-256 redone."""
    snn, x = network
    graph = snnconv.export_nir(snn)
    save_prefix(snn, graph, "net.nir")
    name = graph.metadata[PREFIX_FILE_KEY]
    payload = torch.load(name, weights_only=True)
    inner = payload["graph"]
    if how == "prefix keyword name":
        _attack(inner, how)
    else:
        _attack(_prefix_graph(inner), how)
    torch.save(_forge(payload), name)
    with open(name, "rb") as fh:
        graph.metadata[PREFIX_SHA256_KEY] = hashlib.sha256(fh.read()).hexdigest()
    with pytest.raises((NIRError, CheckpointError)):
        load_prefix(graph, "net.nir")(x)
    assert not (tmp_path / MARKER).exists()


def test_the_writer_refuses_what_the_reader_would(network):
    """One schema both ways: a graph whose input is not an identifier cannot be saved."""
    snn, _ = network
    net = snn.net
    placeholder = next(n for n in net.graph.nodes if n.op == "placeholder")
    old = placeholder.target
    placeholder.target = "x, y=1"
    try:
        with pytest.raises(UnsupportedModelError, match="identifier"):
            snn.save("never.pt")
    finally:
        placeholder.target = old
    assert not os.path.exists("never.pt")


def test_an_untouched_file_passes_the_schema_and_loads_exactly(network):
    snn, x = network
    snn.save("snn.pt")
    payload = torch.load("snn.pt", weights_only=True)
    check_graph(payload["graph"])
    with torch.no_grad():
        assert torch.equal(SpikingNetwork.load("snn.pt")(x), snn(x))


def test_a_module_named_as_torchvision_names_regnet_blocks_saves_and_loads(tmp_path):
    """torchvision's RegNets name their blocks "block1-0": a module path part with a hyphen
    is data (fx quotes it), so such a network saves and loads exactly."""
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential()
            self.trunk.add_module("block1-0", nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()))
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.trunk(x), 1), 1))

    torch.manual_seed(0)
    x = torch.rand(16, 1, 8, 8)
    snn, _ = snnconv.convert(Named().eval(), [(x, torch.zeros(16, dtype=torch.long))], T=2,
                             finetune_epochs=0, reconstruction_steps=0, progress=False,
                             on_collapse="warn")
    assert any("block1-0" in str(n.target) for n in snn.net.graph.nodes if n.op == "call_module")
    snn.save("snn.pt")
    with torch.no_grad():
        assert torch.equal(SpikingNetwork.load("snn.pt")(x), snn(x))
