"""ConversionMeta: JSON round trip, atomic writes."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from snnconv.io.atomic import atomic_write_bytes, atomic_write_text
from snnconv.meta import ConversionMeta, StageRecord


def _meta() -> ConversionMeta:
    return ConversionMeta(
        stages=[
            StageRecord("prepare", 0.01),
            StageRecord("fold", 0.25, {"folded": [{"batchnorm": "bn1", "producers": ["conv1"],
                                                   "max_abs_diff": 2.4e-7}]}),
            StageRecord("qcfs", 1.5, {"L": 8, "lambda": {"relu": 3.25}}),
        ],
        settings={"T": 8, "L": 8, "finetune": None, "val_fraction": 0.1},
        seed=123,
        accuracy={"ann": 0.981, "snn": {"4": 0.95, "8": 0.97}},
    )


def test_meta_round_trips_through_a_json_file(tmp_path):
    meta = _meta()
    path = tmp_path / "run" / "meta.json"  # the folder does not exist yet
    text = meta.to_json(path)
    assert path.read_text() == text + "\n"
    back = ConversionMeta.from_json(path)
    assert back == meta
    assert ConversionMeta.from_json(str(path)) == meta


def test_meta_round_trips_through_a_json_string():
    meta = _meta()
    assert ConversionMeta.from_json(meta.to_json()) == meta
    assert ConversionMeta.from_dict(json.loads(meta.to_json(indent=0))) == meta


def test_meta_records_the_environment():
    env = ConversionMeta().environment
    assert env["torch"] == torch.__version__
    for key in ("python", "numpy", "snnconv", "spikingjelly", "nir"):
        assert env[key]


def test_meta_writes_tensors_as_lists():
    meta = ConversionMeta(stages=[StageRecord("qcfs", changes={"lambda": torch.tensor([1.5, 2.0])})])
    data = json.loads(meta.to_json())
    assert data["stages"][0]["changes"]["lambda"] == [1.5, 2.0]


def test_stage_lookup_names_the_stages_that_ran():
    meta = _meta()
    assert meta.stage("fold").changes["folded"][0]["batchnorm"] == "bn1"
    with pytest.raises(KeyError, match=r"finetune.*prepare"):
        meta.stage("finetune")


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "meta.json"
    atomic_write_text(path, "old\n")
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["meta.json"]


def test_atomic_write_that_fails_keeps_the_old_content(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "text, not bytes")  # the write itself fails
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["meta.json"]


def test_atomic_write_gives_the_file_the_usual_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        path = tmp_path / "meta.json"
        atomic_write_text(path, "{}\n")
        mode = stat.S_IMODE(path.stat().st_mode)
    finally:
        os.umask(mask)
    assert mode == 0o644  # not mkstemp's 0600
