"""One energy convention everywhere: the ANN's MACs are its synapses (padding excluded), the
same figure in ``analysis`` / ``evaluate`` / the report and in every backend and ``snnconv run``;
ratios are SNN / ANN and labelled so."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from snnconv.cli import main
from snnconv.energy import E_MAC_PJ, conv_macs
from snnconv.nir_io import export_nir, save_nir


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
                 "--limit", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    ev = json.loads((tmp_path / "evaluation.json").read_text())["analysis"]["energy"]
    rec = json.loads((tmp_path / "backends" / "loihi2-sim.json").read_text())
    ann_pj = ev["ann_pj"]
    assert rec["energy_45nm_per_image_nj"]["ann"] * 1e3 == pytest.approx(ann_pj, rel=1e-9)
    assert rec["extra"]["energy"]["ann_per_image_J"] * 1e12 == pytest.approx(ann_pj, rel=1e-9)
    assert rec["macs_total"] / 32 * E_MAC_PJ == pytest.approx(ann_pj, rel=1e-9)
    # printed: both energy lines of run show that ANN figure and label their ratio SNN/ANN
    lines = [line for line in out.splitlines() if "energy" in line and " uJ" in line]
    assert len(lines) == 2 and all("SNN/ANN" in line and "ratio" not in line for line in lines)
    assert _numbers(r"ANN ([\d.]+) uJ", "\n".join(lines)) == [round(ann_pj / 1e6, 3)] * 2
    for line in lines:
        snn, ann, ratio = _numbers(r"SNN ([\d.]+) uJ", line)[0], _numbers(r"ANN ([\d.]+) uJ", line)[0], \
            _numbers(r"SNN/ANN ([\d.]+)", line)[0]
        assert ratio == pytest.approx(snn / ann, abs=0.01)
    assert f"ANN {ann_pj / 1e3:.1f} nJ, SNN/ANN {ev['ratio']:.2f}" in out  # evaluate's line
