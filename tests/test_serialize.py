"""SpikingNetwork.save / load: exact round trips, weights_only files, refusals of foreign files."""

from __future__ import annotations

import operator
import struct
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv import models
from snnconv.config import MAX_T
from snnconv.errors import CheckpointError, UnsupportedModelError
from snnconv.io.digest import content_digest
from snnconv.snn.network import FORMAT, FORMAT_VERSION, SpikingNetwork, graph_from_dict, graph_to_dict
from snnconv.stages.fold import fold_batchnorm

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

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


def _signed(payload: dict) -> dict:
    """``payload`` with the digest of its current content (what a careful forger would write)."""
    payload["digest"] = content_digest({k: v for k, v in payload.items() if k != "digest"})
    return payload


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
    """Each damage with a digest that matches it: the structural checks refuse it on their own."""
    payload = _signed(_damage(_saved_payload(tmp_path), how))
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError):
        SpikingNetwork.load(tmp_path / "bad.pt")


def test_only_listed_functions_are_saved():
    """The function table is the allow-list: arithmetic and pooling, nothing that runs code."""
    from snnconv.snn.network import FUNCTIONS

    assert FUNCTIONS["operator.add"] is operator.add
    assert not any(name.startswith(("os.", "subprocess.", "builtins.eval", "builtins.exec"))
                   for name in FUNCTIONS)


# --------------------------------------------------------------------------------------------
# files that changed after they were saved


def _records(path) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every tensor record in a torch zip file (stored uncompressed)."""
    raw = path.read_bytes()
    out = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if "/data/" in info.filename and info.file_size:
                n, m = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
                out.append((info.filename, info.header_offset + 30 + n + m, info.file_size))
    return out


def test_one_flipped_byte_in_any_tensor_is_refused(tmp_path):
    snn, _ = _snn("resnet8", True)
    snn.save(tmp_path / "snn.pt")
    raw = (tmp_path / "snn.pt").read_bytes()
    records = _records(tmp_path / "snn.pt")
    assert len(records) >= len(snn.net.state_dict())  # weights, and the tensors of configs
    for _name, offset, size in records:
        data = bytearray(raw)
        data[offset + size // 2] ^= 0x10
        (tmp_path / "flipped.pt").write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="changed after it was saved"):
            SpikingNetwork.load(tmp_path / "flipped.pt")


def test_a_file_without_its_digest_is_refused(tmp_path):
    payload = _saved_payload(tmp_path)
    del payload["digest"]
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="without its digest"):
        SpikingNetwork.load(tmp_path / "bad.pt")


def test_a_version_1_file_is_refused_with_what_to_do(tmp_path):
    """Files of the format before the digest: refused (their values cannot be verified)."""
    snn, _ = _snn("small_cnn", False)
    snn.save(tmp_path / "new.pt")
    payload = torch.load(tmp_path / "new.pt", weights_only=True)
    payload["version"] = 1
    del payload["digest"]
    torch.save(payload, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match="format version 1; this snnconv reads version 2.*convert"):
        SpikingNetwork.load(tmp_path / "old.pt")


def test_a_current_file_without_v_init_is_refused(tmp_path):
    payload = _saved_payload(tmp_path)
    payload["state_dict"] = {k: v for k, v in payload["state_dict"].items() if not k.endswith(".v_init")}
    torch.save(_signed(payload), tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="declares 'v_init'.*does not store"):
        SpikingNetwork.load(tmp_path / "bad.pt")


def test_a_config_larger_than_its_weights_is_refused_before_allocation(tmp_path):
    """A Linear of 16384 x 32768 (2 GiB) declared in a file of a few KiB: the declared shape is
    computed without allocating, and compared with the stored one."""
    payload = _saved_payload(tmp_path)
    name, spec = next((k, v) for k, v in payload["graph"]["modules"].items() if v["type"] == "Linear")
    stored = tuple(payload["state_dict"][f"{name}.weight"].shape)
    spec["config"].update(in_features=16384, out_features=32768)
    torch.save(_signed(payload), tmp_path / "big.pt")
    assert (tmp_path / "big.pt").stat().st_size < 2**20
    with pytest.raises(CheckpointError, match=rf"module '{name}' \(Linear\): its config declares 'weight' "
                                              rf"of shape \(32768, 16384\).*stores {re_tuple(stored)}"):
        SpikingNetwork.load(tmp_path / "big.pt")


def re_tuple(t: tuple) -> str:
    return r"\(" + ", ".join(str(s) for s in t) + r"\)"


def test_a_T_above_the_bound_is_refused(tmp_path):
    payload = _saved_payload(tmp_path)
    payload["T"] = MAX_T + 1
    torch.save(_signed(payload), tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=f"T={MAX_T + 1}, above the bound"):
        SpikingNetwork.load(tmp_path / "bad.pt")


def test_a_network_with_an_analog_prefix_saves_and_loads_bit_identically(tmp_path):
    """A max-pooling stem runs once in analog (snnconv.constructs.prefix); the file holds it as a nested
    graph, and the loaded network gives the same outputs."""
    import snnconv
    from snnconv.constructs.prefix import analog_prefix

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4)).eval()
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    snn, _ = snnconv.convert(model, data, T=4, finetune_epochs=0, progress=False, on_collapse="warn")
    assert analog_prefix(snn) is not None
    path = tmp_path / "snn.pt"
    snn.save(path)
    back = SpikingNetwork.load(path)
    assert analog_prefix(back) is not None
    x = data[0][0]
    with torch.no_grad():
        assert torch.equal(snn.run(x), back.run(x))
