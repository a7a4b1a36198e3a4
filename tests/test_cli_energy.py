"""One energy convention everywhere: the ANN's MACs are its synapses (padding excluded), the
same figure in ``analysis`` / ``evaluate`` / the report and in every backend and ``snnconv run``;
ratios are SNN / ANN and labelled so."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from snnconv.analysis.activity import analyse
from snnconv.analysis.energy import ARITHMETIC, E_MAC_PJ, conv_macs
from snnconv.cli import main
from snnconv.snn.nir_io import export_nir, save_nir
from snnconv_backends.loihi2.cost import CHIP_MODEL


@pytest.mark.parametrize("seed", range(40))
def test_conv_macs_count_the_taps_that_land_on_the_input(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    groups = pick(1, 2)
    c_in, c_out = groups * pick(1, 3), groups * pick(1, 2)
    size = (pick(5, 7), pick(5, 8))  # at least the largest dilated kernel (5)
    k, s, d = (pick(1, 2, 3), pick(1, 3)), (pick(1, 2), pick(1, 3)), (pick(1, 2), 1)
    p = (pick(0, 1, 2), pick(0, 1))
    weight_shape = (c_out, c_in // groups, *k)
    # the brute force: an all-ones convolution of an all-ones input counts the valid taps
    ones = F.conv2d(torch.ones(1, c_in, *size, dtype=torch.float64),
                    torch.ones(weight_shape, dtype=torch.float64), None, s, p, d, groups)
    assert conv_macs((c_in, *size), weight_shape, s, p, d) == int(ones.sum())


def _numbers(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, text)]


def test_run_evaluate_and_the_backend_report_show_one_ann_energy(small_digits_snn, tmp_path, capsys):
    small_digits_snn.save(tmp_path / "snn.pt")
    save_nir(export_nir(small_digits_snn), tmp_path / "snn.nir")
    assert main(["evaluate", str(tmp_path), "--T", "2", "--limit", "32", "--out", str(tmp_path)]) == 0
    assert main(["run", str(tmp_path / "snn.nir"), "--backend", "loihi2-sim", "--T", "2",
                 "--limit", "32"]) == 0
    out = capsys.readouterr().out
    ev = json.loads((tmp_path / "evaluation.json").read_text())["analysis"]["energy"]
    rec = json.loads((tmp_path / "backends" / "loihi2-sim_T2_digits_32img.json").read_text())
    ann_pj = ev["ann_pj"]
    assert rec["energy"]["ann_pj"] == pytest.approx(ann_pj, rel=1e-9)
    assert rec["extra"]["energy"]["ann_per_image_J"] * 1e12 == pytest.approx(ann_pj, rel=1e-9)
    assert rec["macs_total"] / 32 * E_MAC_PJ == pytest.approx(ann_pj, rel=1e-9)
    # printed: each energy line names its model and labels its ratio SNN/ANN
    lines = [line for line in out.splitlines() if line.startswith("energy per image")]
    assert len(lines) == 3 and all("SNN/ANN" in line and " ratio " not in line for line in lines)
    assert sum(ARITHMETIC in line for line in lines) == 2  # evaluate's and run's
    assert sum(CHIP_MODEL in line for line in lines) == 1  # the Loihi row only, as chip figures
    for line in lines:
        snn, ann = _numbers(r"SNN ([\d.]+) [nu]J", line)[0], _numbers(r"ANN ([\d.]+) [nu]J", line)[0]
        assert _numbers(r"SNN/ANN ([\d.]+)", line)[0] == pytest.approx(snn / ann, abs=0.01)


def _printed_ratio(out: str) -> list[float]:
    return _numbers(r"synaptic operations at 45 nm: SNN [\d.]+ nJ, ANN [\d.]+ nJ, SNN/ANN ([\d.]+)", out)


def test_evaluate_run_cpu_the_api_and_the_report_give_one_figure_for_one_run(small_digits_snn, digits_data,
                                                                             tmp_path, capsys):
    """The arithmetic comparison of the same images is one number on every path."""
    small_digits_snn.save(tmp_path / "snn.pt")
    save_nir(export_nir(small_digits_snn), tmp_path / "snn.nir")
    assert main(["evaluate", str(tmp_path), "--data", "digits", "--T", "4", "--limit", "24",
                 "--out", str(tmp_path)]) == 0
    assert main(["run", str(tmp_path / "snn.nir"), "--backend", "cpu", "--data", "digits", "--T", "4",
                 "--limit", "24", "--quiet"]) == 0
    printed = _printed_ratio(capsys.readouterr().out)
    from snnconv.data import stratified_subset

    x = digits_data[1].tensors[0][stratified_subset(digits_data[1], 24).indices]  # the images --limit 24 draws
    api = analyse(small_digits_snn, x, T=4).energy()
    ev = json.loads((tmp_path / "evaluation.json").read_text())["analysis"]["energy"]
    cpu = json.loads((tmp_path / "backends" / "cpu_T4_digits_24img.json").read_text())["energy"]
    assert api["ratio"] == pytest.approx(ev["ratio"], rel=1e-12)
    assert cpu["ratio"] == pytest.approx(api["ratio"], rel=1e-9)
    assert cpu["snn_pj"] == pytest.approx(api["snn_pj"], rel=1e-9)
    assert printed == [round(api["ratio"], 3)] * 2
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    rows = re.findall(r"<tr><td>([^<]*)</td><td>\d+</td><td>4</td><td>" + ARITHMETIC
                      + r"</td>.*?<td>([\d.]+)</td></tr>", page)
    assert [t for t, _ in rows] == ["evaluate (torch SNN)", "run --backend cpu"]
    assert [float(r) for _, r in rows] == [round(api["ratio"], 3)] * 2
    assert "Why two targets differ" in page


class _Fire(torch.nn.Module):
    """A SqueezeNet Fire module's shape: two branches of spikes concatenated, then a convolution."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.e1, self.e3 = torch.nn.Conv2d(4, 3, 1), torch.nn.Conv2d(4, 5, 3, padding=1)
        self.squeeze = torch.nn.Conv2d(8, 4, 1)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.cat([torch.relu(self.e1(x)), torch.relu(self.e3(x))], 1)
        return self.fc(torch.relu(self.squeeze(x)).flatten(1))


def _fire_snn(T: int):
    """:class:`_Fire` converted training-free on 32 random images at ``T``; and those images."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import snnconv

    torch.manual_seed(0)
    x = torch.rand(32, 1, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snn, _ = snnconv.convert(_Fire(), DataLoader(TensorDataset(x, torch.zeros(32, dtype=torch.long)),
                                                      batch_size=16),
                                 T=T, finetune_epochs=0, reconstruction_steps=0, progress=False)
    return snn, x


def test_a_concatenation_of_spikes_costs_what_the_layer_after_it_counts():
    """Spikes through a concatenation (and the per-channel scales before it) reach the convolution
    after it as events: the torch analysis and the cpu backend count the same synaptic
    operations and ANN MACs, the concatenation's placements no MAC, nothing as dense MACs."""
    from snnconv.backends import get

    snn, x = _fire_snn(T=4)
    a = analyse(snn, x[:8], 4)
    r = get("cpu").compile(export_nir(snn)).run(x[:8], 4)
    assert not a.dense_macs and a.synops.get("squeeze", 0) > 0
    assert sum(r.synops.values()) == pytest.approx(sum(a.synops.values()), rel=1e-12)
    assert sum(r.macs.values()) == pytest.approx(sum(a.macs.values()), rel=1e-12)
    assert set(r.macs) == {"stem", "e1", "e3", "squeeze", "fc"}


def test_a_concatenation_marker_on_other_weights_is_refused():
    """A node marked as a concatenation's part is read as one only if its weight is a one-hot
    placement: a file cannot hide a layer's MACs behind the marker."""
    import numpy as np

    from snnconv.errors import NIRError
    from snnconv.nir.format import CONCAT_OP, OP_KEY
    from snnconv.nir.reader import parse

    snn, _ = _fire_snn(T=2)
    graph = export_nir(snn)
    parts = [k for k, n in graph.nodes.items() if (getattr(n, "metadata", None) or {}).get(OP_KEY) == CONCAT_OP]
    assert len(parts) == 2 and all(parse(graph).op(k).params.get("placement") for k in parts)
    w = np.asarray(graph.nodes[parts[0]].weight).copy()
    w[w == 1] = 2.0
    graph.nodes[parts[0]].weight = w
    with pytest.raises(NIRError, match="concatenation's part"):
        parse(graph)


def test_the_chip_row_counts_the_analog_prefix_on_both_sides(tmp_path, capsys):
    """A network with an analog prefix (run off the chip): loihi2-sim's ANN figure is the
    arithmetic rows' (the whole network's MACs), and its record covers every batch."""
    from _loihi_stem import stem_snn

    snn, _ = stem_snn(size=32)
    snn.save(tmp_path / "snn.pt")
    assert main(["export", str(tmp_path)]) == 0
    assert main(["run", str(tmp_path), "--backend", "loihi2-sim", "--data", "synthetic", "--T", "2",
                 "--limit", "24", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    rec = json.loads(next((tmp_path / "backends").glob("loihi2-sim_*.json")).read_text())
    chip = rec["extra"]["energy"]
    assert chip["analog_prefix_macs_per_image"] > 0
    assert chip["ann_per_image_J"] * 1e12 == pytest.approx(rec["energy"]["ann_pj"], rel=1e-9)
    assert chip["ann_macs_per_image"] == pytest.approx(rec["macs_total"] / 24 + chip["analog_prefix_macs_per_image"])
    assert "both sides include the analog prefix" in out
