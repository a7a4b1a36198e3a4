"""snnconv.analysis.activity: spike counts agree with SpikingNetwork.run, synaptic operations are exact."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from snnconv.analysis.activity import E_AC_PJ, E_MAC_PJ, SpikeAnalysis, _structural, analyse, backend_record


def test_spike_counts_and_rates_agree_with_run(small_digits_snn, digits_data):
    x = digits_data[1].tensors[0][:16]
    stats = analyse(small_digits_snn, x, T=6)
    _, counts = small_digits_snn.run(x, T=6, spike_counts=True)
    assert set(stats.spikes_per_step) == set(counts)
    for name, c in counts.items():
        assert stats.spikes_per_step[name] == pytest.approx(c.tolist())
        assert stats.firing_rate[name] == pytest.approx(c.sum().item() / (stats.neurons[name] * 6 * 16))
        assert 0.0 <= stats.firing_rate[name] <= 1.0
        assert all(0 <= t < 6 and 0 <= i < 64 for t, i in stats.raster[name])
    # the first layer sees the static image once (MACs); every other weight layer is spike-driven
    assert list(stats.static_macs) == ["conv1"] and "conv1" not in stats.synops
    assert set(stats.synops) | set(stats.static_macs) == set(stats.macs)


def test_synaptic_events_are_counted_exactly():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    s = (torch.rand(2, 3, 9, 9) < 0.3).float()
    expected = 0
    padded = F.pad(s, (1, 1, 1, 1))
    for b in range(2):
        for i in range(5):
            for j in range(5):
                expected += padded[b, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].sum().item() * 5
    assert _structural(conv, s).item() == expected
    lin = nn.Linear(7, 4)
    v = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    assert _structural(lin, v).item() == 3 * 4  # spikes x outgoing synapses


def test_energy_and_json_round_trip(small_digits_snn, digits_data):
    stats = analyse(small_digits_snn, digits_data[1].tensors[0][:8], T=4)
    e = stats.energy()
    assert e["ann_pj"] == pytest.approx(sum(stats.macs.values()) * E_MAC_PJ / 8)
    assert e["snn_pj"] == pytest.approx(((sum(stats.static_macs.values()) + sum(stats.dense_macs.values())) * E_MAC_PJ
                                         + sum(stats.synops.values()) * E_AC_PJ) / 8)
    again = SpikeAnalysis.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again.energy() == pytest.approx(e)
    with pytest.raises(TypeError, match="SpikingNetwork"):
        analyse(nn.Linear(2, 2), torch.zeros(1, 2))


def test_backend_record_scores_a_result_against_labels_and_the_reference():
    class Result:
        outputs = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]] * 3)  # [T=3, B=3, 2]
        spikes = {}
        synops = {"fc": 10.0}
        macs = {"fc": 4.0}
        extra = {"energy": {"total_nj": 30.0}, "resources": {"cores": 2}}

    rec = backend_record("x", Result(), torch.tensor([0, 1, 1]), torch.tensor([0, 1, 0]), T=3, wall_s=0.5)
    assert rec["accuracy"] == pytest.approx(200 / 3) and rec["agreement"] == 100.0
    assert rec["energy_per_image_nj"] == pytest.approx(10.0) and rec["synops_total"] == 10.0
    json.dumps(rec)
    with pytest.raises(ValueError, match="expected"):
        backend_record("x", Result(), torch.tensor([0, 1]), torch.tensor([0, 1]), T=3, wall_s=0.0)
