"""snnconv.analysis.activity.evaluation_record: what ``evaluation.json`` holds, measured as its parts are."""

from __future__ import annotations

import json

from torch.utils.data import DataLoader

from snnconv.analysis.activity import ANALYSIS_IMAGES, analyse, evaluation_record
from snnconv.analysis.metrics import accuracy_by_T


def test_evaluation_record_is_accuracy_by_T_and_the_first_batch_analysed(small_digits_snn, digits_data):
    loader = DataLoader(digits_data[1], batch_size=100)
    record = evaluation_record(small_digits_snn, loader, [4, 1, 2], label="net.pt", progress=False)
    assert record["network"] == "net.pt"
    expected = accuracy_by_T(small_digits_snn, loader, [1, 2, 4])
    assert record["accuracy"] == {str(t): a for t, a in expected.items()}
    first = analyse(small_digits_snn, digits_data[1].tensors[0][:ANALYSIS_IMAGES], T=4)
    assert record["analysis"] == json.loads(json.dumps(first.to_dict()))
    assert json.loads(json.dumps(record)) == record  # JSON-ready as it is
