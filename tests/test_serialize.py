"""SpikingNetwork.save / load: exact round trips, weights_only files, refusals of foreign files."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv import models
from snnconv.errors import CheckpointError, UnsupportedModelError
from snnconv.fold import fold_batchnorm
from snnconv.network import FORMAT, FORMAT_VERSION, SpikingNetwork, graph_from_dict, graph_to_dict

# --------------------------------------------------------------------------------------------
# helpers


def _batches(shape: tuple[int, ...], n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) for _ in range(n)]


class GroupNet(nn.Module):
    """Grouped conv, identity shortcut (an explicit Scale), method flatten, max-pool made avg."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = torch.relu(self.dw(x) + x)
        return self.fc(self.drop(self.pool(x)).flatten(1))


def _snn(name: str, per_channel: bool, T: int = 5) -> tuple[SpikingNetwork, torch.Tensor]:
    torch.manual_seed(0)
    if name == "groupnet":
        model, shape, kw = GroupNet().eval(), (4, 3, 8, 8), dict(maxpool="avg")
    else:
        model = models.get(name, num_classes=10, in_channels=3).eval()
        shape, kw = (4, 3, 8, 8), {}
    batches = _batches(shape)
    qann = snnconv.calibrate_qcfs(fold_batchnorm(model, batches[0]), batches, L=4,
                                  per_channel=per_channel, progress=False, **kw)
    return snnconv.to_spiking(qann, T=T), batches[1]


# --------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("name", ["small_cnn", "resnet8", "groupnet"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_save_load_reproduces_outputs_exactly(tmp_path, name, per_channel):
    snn, x = _snn(name, per_channel)
    path = tmp_path / "snn.pt"
    snn.save(path)
    loaded = SpikingNetwork.load(path)
    assert loaded.T == snn.T
    assert not loaded.training and not any(m.training for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(loaded(x), snn(x))
        a, ca = snn.run(x, T=3, spike_counts=True)
        b, cb = loaded.run(x, T=3, spike_counts=True)
    assert torch.equal(a, b)
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    ta, tb = snn.thresholds(), loaded.thresholds()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert loaded.meta == snn.meta  # what was absorbed where survives the trip
    # the file is plain data: torch's weights_only loader reads it
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == FORMAT and payload["version"] == FORMAT_VERSION


def test_saved_T_is_the_current_T(tmp_path):
    snn, x = _snn("small_cnn", False, T=5)
    snn.T = 7
    snn.save(tmp_path / "snn.pt")
    loaded = SpikingNetwork.load(tmp_path / "snn.pt")
    assert loaded.T == 7
    with torch.no_grad():
        assert torch.equal(loaded(x), snn(x))
    loaded.T = 2
    with torch.no_grad():
        assert loaded.run(x).shape == (2, 4, 10)


def test_save_overwrites_atomically_and_leaves_no_temporary_files(tmp_path):
    snn, x = _snn("small_cnn", False)
    path = tmp_path / "snn.pt"
    path.write_bytes(b"old")
    snn.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snn.pt"]
    with torch.no_grad():
        assert torch.equal(SpikingNetwork.load(path)(x), snn(x))


def test_graph_dict_round_trip_keeps_nodes():
    snn, _ = _snn("resnet8", True)
    data = graph_to_dict(snn.net)
    rebuilt = graph_from_dict(data)
    assert [(n.op, n.name) for n in rebuilt.graph.nodes] == [(n.op, n.name) for n in snn.net.graph.nodes]
    again = graph_to_dict(rebuilt)
    assert again["nodes"] == data["nodes"]
    assert {k: v["type"] for k, v in again["modules"].items()} == \
        {k: v["type"] for k, v in data["modules"].items()}


def test_saving_an_unknown_module_is_refused():
    class Odd(nn.Module):
        def forward(self, x):
            return x

    snn, _ = _snn("small_cnn", False)
    snn.net.add_submodule("odd", Odd())
    out = next(n for n in snn.net.graph.nodes if n.op == "output")
    with snn.net.graph.inserting_before(out):
        node = snn.net.graph.call_module("odd", (out.args[0],))
    out.replace_input_with(out.args[0], node)
    snn.net.recompile()
    with pytest.raises(UnsupportedModelError, match="Odd"):
        snn.save("/nonexistent-dir-never-written/snn.pt")


# --------------------------------------------------------------------------------------------
# files that are not saved networks


def _saved_payload(tmp_path) -> dict:
    snn, _ = _snn("small_cnn", False)
    snn.save(tmp_path / "good.pt")
    return torch.load(tmp_path / "good.pt", weights_only=True)


def test_text_and_random_bytes_are_refused(tmp_path):
    (tmp_path / "text.pt").write_text("hello, I am not a network\n")
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 8)
    for name in ("text.pt", "noise.pt"):
        with pytest.raises(CheckpointError, match=name):
            SpikingNetwork.load(tmp_path / name)


def test_other_torch_files_are_refused(tmp_path):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "state_dict.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    torch.save(nn.Linear(2, 2), tmp_path / "pickled_module.pt")  # not loadable weights_only
    for name in ("state_dict.pt", "list.pt", "pickled_module.pt"):
        with pytest.raises(CheckpointError):
            SpikingNetwork.load(tmp_path / name)


def test_truncated_file_is_refused(tmp_path):
    snn, _ = _snn("small_cnn", False)
    snn.save(tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        SpikingNetwork.load(tmp_path / "cut.pt")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SpikingNetwork.load(tmp_path / "absent.pt")


def _damage(payload: dict, how: str) -> dict:
    graph = payload["graph"]
    if how == "version":
        payload["version"] = FORMAT_VERSION + 1
    elif how == "no graph":
        del payload["graph"]
    elif how == "unknown module type":
        next(iter(graph["modules"].values()))["type"] = "Evil"
    elif how == "unknown function":
        node = next(n for n in graph["nodes"] if n["op"] == "call_module")
        node.update(op="call_function", target="os.system")
    elif how == "unknown method":
        node = next(n for n in graph["nodes"] if n["op"] == "call_module")
        node.update(op="call_method", target="__reduce__")
    elif how == "get_attr":
        node = next(n for n in graph["nodes"] if n["op"] == "call_module")
        node.update(op="get_attr")
    elif how == "dangling module":
        node = next(n for n in graph["nodes"] if n["op"] == "call_module")
        node["target"] = "not_a_module"
    elif how == "dangling node":
        node = next(n for n in graph["nodes"] if n["op"] == "call_module")
        node["args"] = {"tuple": [{"node": "nowhere"}]}
    elif how == "bad config":
        next(iter(graph["modules"].values()))["config"] = {"no_such_argument": 1}
    elif how == "weights for another graph":
        payload["state_dict"] = {"x": torch.zeros(1)}
    elif how == "bad T":
        payload["T"] = 0
    return payload


@pytest.mark.parametrize("how", ["version", "no graph", "unknown module type", "unknown function",
                                 "unknown method", "get_attr", "dangling module", "dangling node",
                                 "bad config", "weights for another graph", "bad T"])
def test_damaged_payloads_are_refused(tmp_path, how):
    payload = _damage(_saved_payload(tmp_path), how)
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError):
        SpikingNetwork.load(tmp_path / "bad.pt")


def test_only_listed_functions_are_saved():
    """The function table is the allow-list: arithmetic and pooling, nothing that runs code."""
    from snnconv.network import FUNCTIONS

    assert FUNCTIONS["operator.add"] is operator.add
    assert not any(name.startswith(("os.", "subprocess.", "builtins.eval", "builtins.exec"))
                   for name in FUNCTIONS)
