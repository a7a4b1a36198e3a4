"""What ``snnconv run`` and ``snnconv report`` put on the page: ``--quiet`` keeps the results and
drops the tables; the report shows evaluate's T sweep beside convert's, a T in every energy row,
and marks a backend result on a subset of the test images."""

from __future__ import annotations

import json

from snnconv.cli import main
from snnconv.nir.file import save_nir
from snnconv.snn.nir_io import export_nir


def test_run_quiet_prints_the_results_without_tables(small_digits_snn, tmp_path, capsys):
    save_nir(export_nir(small_digits_snn), tmp_path / "snn.nir")
    args = ["run", str(tmp_path / "snn.nir"), "--data", "digits", "--T", "2", "--limit", "32"]
    for backend in ("cpu", "loihi2-sim"):
        assert main(args + ["--backend", backend]) == 0
        loud = capsys.readouterr().out.splitlines()
        assert main(args + ["--backend", backend, "--quiet"]) == 0
        quiet = capsys.readouterr().out.splitlines()
        assert len(quiet) <= 8 < len(loud), quiet
        assert not any(line.startswith(("layer ", "----")) for line in quiet)
        assert any(line.startswith("accuracy (mean readout") for line in quiet)
        assert any(line.startswith("energy per image") for line in quiet)
        assert any("wrote" in line for line in quiet)


def test_the_report_shows_the_T_sweep_T_in_every_energy_row_and_marks_subsets(small_digits_snn, tmp_path):
    small_digits_snn.save(tmp_path / "snn.pt")
    (tmp_path / "meta.json").write_text(json.dumps({
        "settings": {"T": 4, "data": "digits", "eval_images": 360},
        "accuracy": {"ann": 97.0, "snn": {"4": 95.0}}}))
    assert main(["evaluate", str(tmp_path), "--data", "digits", "--T", "1", "2", "4", "8", "--quiet"]) == 0
    save_nir(export_nir(small_digits_snn), tmp_path / "snn.nir")
    assert main(["run", str(tmp_path / "snn.nir"), "--backend", "cpu", "--data", "digits", "--T", "4",
                 "--limit", "128", "--quiet"]) == 0
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    accuracy = page.split("<h2>Accuracy against time steps</h2>")[1].split("<h2>")[0]
    for t in (1, 2, 8):  # evaluate's sweep, beside convert's T=4
        assert f"<tr><td>SNN (snnconv evaluate)</td><td>{t}</td>" in accuracy
    assert "(a subset: 128 of 360)" in accuracy
    energy = page.split("<h2>Energy: the SNN against the ANN, per target</h2>")[1].split("<h2>")[0]
    assert "<th>T</th>" in energy
    assert "<tr><td>evaluate (torch SNN)</td><td>" in energy and "<td>8</td>" in energy
    assert "<tr><td>run --backend cpu</td><td>128</td><td>4</td>" in energy
