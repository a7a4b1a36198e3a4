"""``snnconv report``: one self-contained page, sections omitted with a note, written atomically."""

from __future__ import annotations

import json
import os
import re

import pytest

from snnconv.errors import DataError
from snnconv.report import load_run, write_report

META = {
    "accuracy": {"ann": 91.0, "folded": 91.0, "qcfs": 90.5, "snn": {"1": 40.0, "2": 70.0, "4": 88.0}},
    "settings": {"T": 4, "L": 8},
    "environment": {"snnconv": "0.1.0"},
    "stages": [{"name": "spiking", "seconds": 0.1,
                "changes": {"neurons": {"if_a": {"theta": [1.0, 2.0, 3.0]}, "if_b": {"theta": 0.5}}}}],
}
EVALUATION = {
    "accuracy": {"4": 88.0},
    "analysis": {"T": 4, "batch": 2, "neurons": {"if_a": 8, "if_b": 4},
                 "spikes_per_step": {"if_a": [1, 2, 3, 4], "if_b": [0, 1, 1, 1]},
                 "firing_rate": {"if_a": 0.15, "if_b": 0.1}, "synops": {"fc": 120.0},
                 "static_macs": {"conv": 500.0}, "macs": {"conv": 500.0, "fc": 400.0},
                 "raster": {"if_a": [[0, 1], [2, 3]], "if_b": []},
                 "energy": {"snn_pj": 1200.0, "ann_pj": 2070.0, "ratio": 0.58, "e_mac_pj": 4.6, "e_ac_pj": 0.9}},
}


def _write(folder, name, data):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _images(page: str) -> int:
    return len(re.findall(r'<img class="plot"[^>]*src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', page))


def test_a_full_run_folder_gives_one_embedded_plot_per_section(tmp_path):
    _write(tmp_path, "meta.json", META)
    _write(tmp_path, "evaluation.json", EVALUATION)
    _write(tmp_path, "finetune.json", {"history": [{"epoch": 1, "loss": 0.5, "train_acc": 80, "val_acc": 85},
                                                    {"epoch": 2, "loss": 0.3, "train_acc": 88, "val_acc": 87}],
                                       "accuracy": {"snn": {"1": 60.0, "4": 90.0}}})
    _write(tmp_path, "backends/cpu.json", {"backend": "cpu", "T": 4, "accuracy": 90.0, "agreement": 100.0,
                                           "synops_total": 1e5, "wall_s": 0.2, "energy_per_image_nj": 3.0})
    path = write_report(tmp_path)
    assert path == str(tmp_path / "report.html")
    page = open(path, encoding="utf-8").read()
    # accuracy, thresholds, firing, raster, fine-tuning, operations, energy
    assert _images(page) == 7
    assert 'class="note"' not in page
    assert "src=\"http" not in page and "href=" not in page  # self-contained
    assert "<td>cpu</td>" in page and "SNN fine-tuned T=4" in page
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []  # atomic write left nothing


def test_missing_parts_are_omitted_with_a_note_naming_the_command(tmp_path):
    _write(tmp_path, "meta.json", META)
    page = open(write_report(tmp_path, tmp_path / "out" / "r.html"), encoding="utf-8").read()
    assert _images(page) == 2  # accuracy and thresholds only
    for command in ("snnconv evaluate", "snnconv finetune", "snnconv run"):
        assert command in page


def test_a_folder_without_run_files_or_with_broken_json_is_refused(tmp_path):
    with pytest.raises(DataError, match="none of meta.json"):
        load_run(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        write_report(tmp_path)
    assert not (tmp_path / "report.html").exists()
