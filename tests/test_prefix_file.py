"""The analog prefix of an exported network, as a file beside its NIR file: written by export,
checked and applied by run, refused when it is missing, changed or named as a path."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snnconv
from snnconv.cli import main
from snnconv.constructs.prefix import analog_prefix
from snnconv.data import digits
from snnconv.errors import NIRError
from snnconv.nir.format import PREFIX_FILE_KEY, PREFIX_SHA256_KEY
from snnconv.snn.prefixfile import load_prefix, save_prefix
from snnconv_backends import get


class _DigitsStem(nn.Module):
    """A stem (conv, BN, ReLU, max-pooling) for 1x8x8 digits, then a spiking body."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.maxpool = nn.MaxPool2d(2)
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.a(x)), 1), 1))


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory):
    """A converted digits network with an analog prefix, saved as a network file."""
    torch.manual_seed(0)
    train, _ = digits(seed=0)
    model = _DigitsStem()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    x, y = train.tensors
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    snn, _ = snnconv.convert(model, [(x[:256], y[:256])], T=4, finetune_epochs=0, progress=False,
                             on_collapse="warn")
    assert analog_prefix(snn) is not None
    folder = tmp_path_factory.mktemp("prefixed")
    snn.save(folder / "snn.pt")
    return snn, folder


def test_the_prefix_file_and_the_graph_together_are_the_network(prefixed, tmp_path):
    snn, _ = prefixed
    graph = snnconv.export_nir(snn)
    path = save_prefix(snn, graph, tmp_path / "net.nir")
    assert path.endswith("net.prefix.pt") and graph.metadata[PREFIX_FILE_KEY] == "net.prefix.pt"
    snnconv.save_nir(graph, tmp_path / "net.nir")
    loaded = snnconv.load_nir(tmp_path / "net.nir")
    prefix = load_prefix(loaded, tmp_path / "net.nir")
    x = torch.rand(16, 1, 8, 8) * 16
    with torch.no_grad():
        assert torch.equal(prefix(x), analog_prefix(snn)(x))
        ref, counts = snn.run(x, 4, spike_counts=True)
        result = get("cpu").compile(loaded).run(prefix(x), 4)
    assert torch.equal(result.outputs, ref)
    assert all(torch.equal(result.spikes[k], c.double()) for k, c in counts.items())


def test_save_nir_and_load_nir_write_and_read_a_network_with_its_prefix_in_one_call(prefixed, small_digits_snn,
                                                                                     tmp_path):
    snn, _ = prefixed
    written = snnconv.save_nir(snn, tmp_path / "net.nir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.nir", "net.prefix.pt"]
    graph, prefix = snnconv.load_nir(tmp_path / "net.nir", with_prefix=True)
    assert graph.metadata[PREFIX_FILE_KEY] == written.metadata[PREFIX_FILE_KEY] == "net.prefix.pt"
    x = torch.rand(16, 1, 8, 8) * 16
    with torch.no_grad():
        ref = snn.run(x, 4)
        assert torch.equal(get("cpu").compile(graph).run(prefix(x), 4).outputs, ref)
    # a network without a prefix: one file, and the images go in as they are
    snnconv.save_nir(small_digits_snn, tmp_path / "plain.nir")
    assert not (tmp_path / "plain.prefix.pt").exists()
    graph, prefix = snnconv.load_nir(tmp_path / "plain.nir", with_prefix=True)
    assert isinstance(prefix, nn.Identity)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(get("cpu").compile(graph).run(prefix(x), 4).outputs, small_digits_snn.run(x, 4))
    assert isinstance(snnconv.load_nir(tmp_path / "plain.nir"), type(graph))  # the graph alone, as before
    with pytest.raises(NIRError, match="SpikingNetwork or a nir.NIRGraph"):
        snnconv.save_nir(nn.Linear(2, 2), tmp_path / "bad.nir")


def test_a_network_without_a_prefix_writes_no_prefix_file(small_digits_snn, tmp_path):
    graph = snnconv.export_nir(small_digits_snn)
    assert save_prefix(small_digits_snn, graph, tmp_path / "net.nir") is None
    assert list(tmp_path.iterdir()) == [] and PREFIX_FILE_KEY not in graph.metadata
    assert load_prefix(graph, tmp_path / "net.nir") is None
    with pytest.raises(NIRError, match="not an analog prefix's output"):
        load_prefix(graph, tmp_path / "net.nir", tmp_path / "some.prefix.pt")


@pytest.mark.parametrize("damage", ["missing", "changed", "path_in_name", "not_a_prefix"])
def test_a_missing_changed_or_misnamed_prefix_file_is_refused(prefixed, small_digits_snn, tmp_path, damage):
    snn, _ = prefixed
    graph = snnconv.export_nir(snn)
    path = save_prefix(snn, graph, tmp_path / "net.nir")
    if damage == "missing":
        (tmp_path / "net.prefix.pt").unlink()
        match = "missing"
    elif damage == "changed":
        with open(path, "r+b") as fh:
            fh.seek(100)
            byte = fh.read(1)
            fh.seek(100)
            fh.write(bytes([byte[0] ^ 1]))
        match = "SHA-256"
    elif damage == "path_in_name":
        graph.metadata[PREFIX_FILE_KEY] = "../elsewhere/net.prefix.pt"
        match = "names no prefix file"
    else:  # a real network file with the recorded digest, but not a prefix
        small_digits_snn.save(path)
        import hashlib

        graph.metadata[PREFIX_SHA256_KEY] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        match = "not an analog prefix"
    with pytest.raises(NIRError, match=match):
        load_prefix(graph, tmp_path / "net.nir")


def test_export_writes_the_prefix_beside_the_file_and_run_applies_it(prefixed, capsys):
    _, folder = prefixed
    assert main(["export", str(folder / "snn.pt"), str(folder / "snn.nir"), "--quiet"]) == 0
    assert "snn.prefix.pt" in capsys.readouterr().out
    assert (folder / "snn.prefix.pt").exists()
    assert main(["inspect", str(folder / "snn.nir")]) == 0
    assert "analog prefix in snn.prefix.pt" in capsys.readouterr().out
    assert main(["run", str(folder / "snn.nir"), "--data", "digits", "--quiet"]) == 0
    rec = json.loads(next((folder / "backends").glob("cpu_T*_digits_*img.json")).read_text())
    assert rec["agreement"] == 100.0 and rec["accuracy"] > 50.0
    (folder / "snn.prefix.pt").rename(folder / "moved.pt")
    assert main(["run", str(folder / "snn.nir"), "--data", "digits", "--quiet"]) != 0
    assert "missing" in capsys.readouterr().err
    assert main(["run", str(folder / "snn.nir"), "--data", "digits", "--quiet",
                 "--prefix", str(folder / "moved.pt")]) == 0
