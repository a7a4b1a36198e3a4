"""``snnconv run FILE.nir`` and ``snnconv backends``."""

from __future__ import annotations

import pytest
import torch

import snnconv
from snnconv.cli import main
from snnconv.snn.nir_io import export_nir, save_nir

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


@pytest.fixture
def digits_nir(small_digits_snn, tmp_path):
    path = tmp_path / "digits.nir"
    save_nir(export_nir(small_digits_snn), path)
    return path


def test_run_prints_accuracy_spikes_synops_and_energy(digits_nir, capsys):
    assert main(["run", str(digits_nir), "--backend", "cpu", "--data", "digits", "--T", "4",
                 "--limit", "100", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "digits test set (100 images), T=4" in out
    assert "accuracy (mean readout over T=4):" in out and "accuracy by t: 1:" in out
    assert "spikes per neuron layer" in out and "synaptic operations" in out
    assert "pJ per AC" in out and "Horowitz" in out
    # every neuron layer of the file is listed
    from snnconv.nir.reader import parse

    for op in parse(snnconv.snn.nir_io.load_nir(digits_nir)).neurons:
        assert f"\n{op.name} " in out


def test_run_accuracy_is_the_cpu_backend_accuracy(digits_nir, digits_data, capsys):
    from snnconv.data import stratified_subset

    _, test = digits_data
    x, y = (t[stratified_subset(test, 50).indices] for t in test.tensors)  # the images --limit 50 draws
    graph = snnconv.snn.nir_io.load_nir(digits_nir)
    r = snnconv.backends.get("cpu").compile(graph).run(x, 3)
    acc = 100 * float((r.outputs.mean(0).argmax(1) == y).float().mean())
    assert main(["run", str(digits_nir), "--data", "digits", "--T", "3", "--limit", "50",
                 "--option", "dtype=float64"]) == 0
    assert f"accuracy (mean readout over T=3): {acc:.2f}%" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--option", "fast=1"], "no option 'fast'"),
    (["--option", "fast"], "is not KEY=VALUE"),
    (["--data", "fashion_mnist", "--data-root", "/nonexistent"], "Fashion-MNIST"),
    (["--T", "0"], "argument --T: expected an integer >= 1, got '0'"),
])
def test_run_bad_input_exits_2_with_one_line(digits_nir, argv, message, capsys):
    assert main(["run", str(digits_nir), "--limit", "8"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("snnconv run: ") and message in err and err.count("\n") == 1


def test_run_refuses_data_of_the_wrong_shape(tmp_path, capsys):
    from snnconv import models

    model = models.small_cnn(num_classes=10, in_channels=3, width=4)
    x = torch.rand(8, 3, 16, 16)
    snn, _ = snnconv.convert(model, [(x, torch.zeros(8, dtype=torch.long))], T=2, calib_batches=1,
                             bias_calibration=False, progress=False)
    path = tmp_path / "rgb.nir"
    save_nir(export_nir(snn, input_shape=(3, 16, 16)), path)
    assert main(["run", str(path), "--data", "digits", "--limit", "8"]) == 2
    err = capsys.readouterr().err
    assert "are 8x8 px with 1 channel(s)" in err and "converted for 16x16 px with 3 channel(s)" in err
    assert "images with 3 channel(s), not 1" in err


def test_backends_lists_each_backend_and_why_not(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["backend", "usable", "why", "not"]
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(lines) >= {"cpu", "gpu", "loihi2-sim", "lava"}
    assert lines["cpu"].split()[1] == "yes"
    if not torch.cuda.is_available():
        assert "no CUDA device" in lines["gpu"]
