"""The diagnosis: its causes add up to the departure, a layer run as its ANN activation has none
of its own, the neuron's constant-input rate is the simulated neuron's, and the record and the
command line hold."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.diagnosis import Diagnosis, causes_of, diagnose, needed_T, site_rates
from snnconv.snn.neuron import IFNeuron


@pytest.fixture(scope="module")
def converted(_small_digits_ann, digits_data):
    import copy

    train_set, test_set = digits_data
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    ann = copy.deepcopy(_small_digits_ann)
    snn, _ = snnconv.convert(ann, loader, T=2, finetune_epochs=0, progress=False)
    return ann, snn, DataLoader(test_set, batch_size=128)


@pytest.mark.parametrize("reset,burst", [("subtract", 1), ("subtract", 3), ("zero", 1)])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_site_rates_is_the_neuron_on_a_constant_input(reset, burst, T):
    torch.manual_seed(T)
    theta = torch.tensor([0.3, 1.0, 2.5])
    v0 = torch.tensor([0.5, 0.2, 0.9]) if reset == "subtract" else None
    unit = IFNeuron(theta, T, reset=reset, burst=burst, v_init=v0)
    m = torch.randn(64, 3, 4) * 2
    with torch.no_grad():
        spikes = unit(m.repeat(T, 1, 1)).reshape(T, 64, 3, 4)
    simulated = spikes.mean(0) * theta.reshape(1, 3, 1)
    assert torch.allclose(site_rates(m, unit, T), simulated, atol=1e-5)


def test_causes_add_up_to_the_departure():
    torch.manual_seed(0)
    a, m, r, q = (torch.rand(16, 4, 3) for _ in range(4))
    theta = torch.rand(1, 4, 1) + 0.5
    parts = causes_of(a, m, r, q, theta, lambda x: torch.clamp(x, 0, 0.7))
    assert torch.allclose(sum(parts.values()), r - a, atol=1e-6)


def test_the_diagnosis_of_a_network(converted):
    ann, snn, test = converted
    d = diagnose(snn, ann, test, images=256)
    assert d.T == 2 and d.images == 256 and d.labelled
    assert len(d.layers) == len(snn.meta["neurons"])
    for layer in d.layers:
        assert layer.site is not None  # every IF layer found its ANN site
        assert set(layer.causes) == {"carried", "clip", "quantisation", "temporal"}
        # the RMS of a sum is at most the sum of the RMS (the causes add up to the departure)
        assert layer.departure <= sum(layer.causes.values()) + 1e-9
        assert layer.own_departure <= layer.causes["clip"] + layer.causes["quantisation"] + \
            layer.causes["temporal"] + 1e-9
    # the ranking is the measured one; the main layers are at most a quarter, at least one
    gains = [next(x.kl_recovered for x in d.layers if x.name == n) for n in d.ranking]
    assert gains == sorted(gains, reverse=True)
    assert 1 <= len(d.main) <= max(1, len(d.layers) // 4) and d.main == d.ranking[:len(d.main)]
    assert d.main_accuracy == d.recovered[str(len(d.main))]
    again = Diagnosis.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again.to_dict() == d.to_dict()
    assert "IF layers that lose most" in d.summary()


def test_a_layer_run_as_its_ann_activation_has_no_departure_of_its_own(converted):
    ann, snn, test = converted
    first = next(iter(snn.meta["neurons"]))
    d = diagnose(snn, ann, test, images=128, ablation=False, analog=[first])
    layer = next(x for x in d.layers if x.name == first)
    assert layer.own_departure == pytest.approx(0.0, abs=1e-6)
    assert layer.departure == pytest.approx(layer.causes["carried"], rel=1e-5)
    # the first layer's input is the image: nothing is carried in but the calibration's shift
    base = diagnose(snn, ann, test, images=128, ablation=False)
    assert base.layers[0].causes["temporal"] == pytest.approx(0.0, abs=1e-6)  # a constant input
    with pytest.raises(snnconv.errors.ConfigError, match="analog"):
        diagnose(snn, ann, test, images=8, ablation=False, analog=["nope"])


def test_needed_T_stops_at_the_first_T_within_the_tolerance(converted, digits_data):
    ann, _, test = converted
    train_set, _ = digits_data
    rec = needed_T(ann, DataLoader(train_set, batch_size=64), test, Ts=(1, 64), tolerance=100.0, images=64)
    assert rec["T"] == 1 and list(rec["curve"]) == ["1"]
    assert math.isfinite(rec["ann"])


def test_diagnose_command(tmp_path):
    from snnconv.cli import main

    run = tmp_path / "run"
    assert main(["convert", "--model", "small_cnn", "--data", "digits", "--train-epochs", "2", "--T", "1", "2",
                 "--finetune-epochs", "0", "--out", str(run), "--quiet"]) == 0
    assert main(["diagnose", str(run), "--data", "digits", "--images", "64", "--quiet"]) == 0
    record = json.loads((run / "diagnosis.json").read_text())
    assert record["T"] == 2 and record["network"] == "snn.pt" and record["layers"]
    assert (run / "diagnosis.png").stat().st_size > 0
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "Where the accuracy goes" in page and "calibrated (and fine-tuned) for T=2" in page
    assert record["run_id"] == json.loads((run / "meta.json").read_text())["settings"]["run_id"]
    # a diagnosis.json that is no such record is read as data: a note, not a crash
    (run / "diagnosis.json").write_text(json.dumps(dict(record, layers="x", run_id=None)))
    assert main(["report", str(run)]) == 0
    assert "is not a record of snnconv diagnose" in (run / "report.html").read_text()
    # one left by another run in the folder is left out
    (run / "diagnosis.json").write_text(json.dumps(dict(record, run_id="another")))
    assert main(["report", str(run)]) == 0
    assert "Left out diagnosis.json" in (run / "report.html").read_text()
