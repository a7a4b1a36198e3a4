"""convert() says, in one line, when fine-tuning left the SNN more accurate than its ANN."""

from __future__ import annotations

import io

import torch
from torch.utils.data import DataLoader, TensorDataset

from snnconv.analysis.summary import beyond_ann, images_in, say_beyond_ann

HISTORY = {"name": "finetune", "changes": {"history": [{"epoch": 1, "loss": 1.0}], "check_accuracy": 80.0}}


def _meta(ann: float, snn: float, stages=(HISTORY,), images: int | None = 5000) -> dict:
    return {"settings": {"T": 4, "eval_images": images}, "accuracy": {"ann": ann, "snn": {"4": snn}},
            "stages": [{"name": "fold", "changes": {"check_accuracy": 75.0}}, *stages]}


def test_the_line_names_both_accuracies_T_and_the_images():
    out = io.StringIO()
    line = say_beyond_ann(_meta(62.2, 73.1), file=out)
    assert out.getvalue() == line + "\n"
    assert line == ("fine-tuning trained the SNN beyond its ANN: 73.10% at T=4 against the ANN's 62.20% on "
                    "the same 5000 images; the SNN is a further-trained network, not only a conversion of "
                    "this ANN")


def test_nothing_is_said_below_the_ann_without_fine_tuning_or_when_quiet():
    out = io.StringIO()
    assert say_beyond_ann(_meta(73.1, 62.2), file=out) is None
    assert say_beyond_ann(_meta(62.2, 73.1, stages=()), file=out) is None  # no BPTT stage: a conversion
    assert say_beyond_ann(_meta(62.2, 73.1), progress=False, file=out) is not None
    assert out.getvalue() == ""


def test_without_evaluation_data_the_calibration_batches_are_compared():
    meta = {"settings": {"T": 4}, "accuracy": {}, "stages": [{"name": "fold", "changes": {"check_accuracy": 75.0}},
                                                            HISTORY]}
    assert beyond_ann(meta)["data"] == "the calibration batches (training data)"


def test_the_images_of_a_loader_are_counted_without_iterating_it():
    data = TensorDataset(torch.zeros(10, 1), torch.zeros(10))
    assert images_in(DataLoader(data, batch_size=4)) == 10
    assert images_in(DataLoader(data, batch_size=4, drop_last=True)) == 8
    assert images_in([(torch.zeros(3, 1), torch.zeros(3))] * 2) == 6
    assert images_in(iter([])) is None


def test_convert_s_own_record_is_read_as_its_json_is():
    from snnconv.meta import ConversionMeta

    meta = ConversionMeta.from_dict(_meta(62.2, 73.1))
    assert beyond_ann(meta) == beyond_ann(meta.to_dict()) == {"snn": 73.1, "ann": 62.2, "T": 4, "images": 5000,
                                                               "data": "the evaluation data"}
