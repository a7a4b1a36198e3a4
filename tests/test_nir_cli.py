"""``snnconv export`` and ``snnconv inspect``: exit 0 with a table, 2 with one line on bad input."""

from __future__ import annotations

import pytest
import torch

from snnconv.cli import main
from snnconv.snn.neuron import neurons
from snnconv.snn.nir_io import from_nir, load_nir

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


@pytest.fixture
def saved_network(small_digits_snn, tmp_path):
    path = tmp_path / "net.pt"
    small_digits_snn.meta["input_shape"] = [1, 8, 8]
    small_digits_snn.save(path)
    return small_digits_snn, path


def test_export_then_inspect(saved_network, tmp_path, capsys):
    snn, path = saved_network
    out = tmp_path / "net.nir"
    assert main(["export", str(path), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    back = from_nir(load_nir(out))
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(back.run(x), snn.run(x))
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["node", "type", "shape"]
    for name, theta in snn.thresholds().items():
        row = next(line for line in lines if line.startswith(name + " "))
        assert "I+Threshold+Scale (subtract)" in row and f"{float(theta):.4g}" in row
    n_params = sum(p.numel() for n, p in snn.net.named_parameters())
    assert lines[-1].startswith("total: ") and f"{len(neurons(snn.net))} neuron layers" in lines[-1]
    assert f"{n_params} parameters" in lines[-1]


def test_export_with_an_input_shape(saved_network, tmp_path, capsys):
    snn, path = saved_network
    snn.meta.pop("input_shape")
    snn.save(path)
    out = tmp_path / "net.nir"
    assert main(["export", str(path), str(out)]) == 2
    assert "input_shape" in capsys.readouterr().err
    assert main(["export", str(path), str(out), "--input-shape", "1,8,8"]) == 0
    assert main(["export", str(path), str(out), "--input-shape", "one"]) == 2


@pytest.mark.parametrize("command", ["export", "inspect"])
def test_bad_input_exits_2_with_one_line(command, tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    for path in (junk, tmp_path / "missing"):
        args = [command, str(path)] + ([str(tmp_path / "out.nir")] if command == "export" else [])
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"snnconv {command}: ") and err.count("\n") == 1
    assert not (tmp_path / "out.nir").exists()
