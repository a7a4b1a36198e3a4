"""``snnconv report``: one self-contained page, sections omitted with a note, written atomically."""

from __future__ import annotations

import json
import os
import re

import pytest
from _pagetext import visible_text

from snnconv.analysis.report import load_run, write_report
from snnconv.errors import DataError

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
    assert "<td>cpu (data not recorded)</td>" in page and "SNN (snnconv finetune)" in page
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []  # atomic write left nothing


def test_missing_parts_are_omitted_with_a_note_naming_the_command(tmp_path):
    _write(tmp_path, "meta.json", META)
    page = open(write_report(tmp_path, tmp_path / "out" / "r.html"), encoding="utf-8").read()
    assert _images(page) == 2  # accuracy and thresholds only
    for command in ("snnconv evaluate", "snnconv finetune", "snnconv run"):
        assert command in page


CONVERTED = {**META, "settings": {"T": 4, "L": 8, "model": "resnet20", "data": "cifar10", "eval_images": 1000,
                                  "device": "cpu", "finetune": {"T": 8},
                                  "budget": {"total_seconds": 375.0, "finetune_steps_run": 560,
                                             "finetune_T": 8}},
             "stages": META["stages"] + [
                 {"name": "prepare", "seconds": 0.1, "changes": {"parameters": 272474}},
                 {"name": "finetune", "seconds": 300.0, "changes": {"history": [
                     {"epoch": 1, "loss": 0.9, "train_acc": 70.0, "steps": 280, "seconds": 150.0},
                     {"epoch": 2, "loss": 0.7, "train_acc": 75.0, "steps": 280, "seconds": 150.0}]}}]}


def test_the_headline_states_network_T_accuracies_with_images_and_the_cost(tmp_path):
    _write(tmp_path, "meta.json", CONVERTED)
    text = visible_text(open(write_report(tmp_path), encoding="utf-8").read())
    assert ("resnet20 on cifar10, converted to a spiking network at T=4: ANN 91.00% \u2192 SNN 88.00% "
            "on 1,000 test images.") in text
    assert ("Conversion cost: 6 min 15 s on cpu; 272,474 parameters; training steps: BPTT fine-tuning 560 "
            "(unrolled over T=8).") in text
    # every accuracy with its image count; the history convert recorded, although finetune.json is absent
    assert "SNN (converted) 4 1,000 88.00" in text and "ANN analog 1,000 91.00" in text
    assert "BPTT in snnconv convert: 560 steps unrolled over T=8; 2 epoch(s), 5 min 00 s" in text
    assert "No fine-tuning" not in text


def test_a_finetuned_snn_above_its_ann_is_said_in_the_headline(tmp_path):
    above = {**CONVERTED, "accuracy": {**CONVERTED["accuracy"], "ann": 62.2, "snn": {"4": 73.1}}}
    _write(tmp_path, "meta.json", above)
    text = visible_text(open(write_report(tmp_path), encoding="utf-8").read())
    assert "Fine-tuning trained the SNN beyond its ANN: 73.10% against 62.20% on the evaluation data" in text


def test_backend_results_on_few_images_stay_off_the_plot_and_are_named(tmp_path):
    from snnconv.analysis.report import few_images

    _write(tmp_path, "meta.json", CONVERTED)
    record = {"backend": "lava", "T": 4, "data": "cifar10", "agreement": 100.0, "synops_total": 1.0, "wall_s": 1.0}
    _write(tmp_path, "backends/lava_T4_cifar10_4img.json", {**record, "images": 4, "accuracy": 100.0})
    _write(tmp_path, "backends/lava_T4_cifar10_1000img.json", {**record, "images": 1000, "accuracy": 87.5})
    text = visible_text(open(write_report(tmp_path), encoding="utf-8").read())
    assert ("Left off the plot (fewer than 100 images, against 1,000 for the others): lava (cifar10) at "
            "T=4: 100.00% on 4 images") in text
    assert "backend lava (cifar10) (few images) 4 4 100.00" in text
    assert "backend lava (cifar10) 4 1,000 87.50" in text  # both kept, each with its count
    assert few_images(4, 1000) and not few_images(64, 64) and not few_images(128, 449)


def test_the_sections_from_evaluation_state_their_network_T_and_images(tmp_path):
    _write(tmp_path, "meta.json", CONVERTED)
    _write(tmp_path, "evaluation.json", {**EVALUATION, "network": "snn_finetuned.pt"})
    text = visible_text(open(write_report(tmp_path), encoding="utf-8").read())
    for section in ("Firing rate per layer", "Spike raster", "Synaptic operations and energy"):
        assert f"{section} (snn_finetuned.pt, T=4, the first 2 test images)" in text
    assert "Threshold distribution (the converted network, T=4)" in text


def test_a_folder_without_run_files_or_with_broken_json_is_refused(tmp_path):
    with pytest.raises(DataError, match="none of meta.json"):
        load_run(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "snn.pt").write_bytes(b"PK")
    with pytest.raises(DataError, match="is a file, not a run folder; give the folder holding it"):
        load_run(tmp_path / "snn.pt")
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        write_report(tmp_path)
    assert not (tmp_path / "report.html").exists()
