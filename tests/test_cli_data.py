"""What ``snnconv convert`` says about the images it uses and what it leaves behind: the image
size in its plan and a warning where the model records another, a --limit that keeps the classes'
shares and is recorded, a warning for a test split too small to mean much and for a folder that
mixes gray and colour images, and an old run replaced only by a complete new one."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from snnconv.cli import main
from snnconv.data import image_folder, labels_of, stratified_subset

#: A factory whose model takes any image size and records the size it was built for.
SIZED = '''
import torch.nn as nn


def build():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 3))
    model.image_size = 16
    return model
'''

CONVERT = ["convert", "--model", "sizednets:build", "--data", "images", "--train-epochs", "1", "--T", "2",
           "--finetune-epochs", "0", "--reconstruction-steps", "0", "--batch-size", "8"]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """``sizednets.py`` and ``images/CLASS/*.png``: 3 classes of 10 RGB images of 12x12 pixels,
    and 3 grayscale ones in the last class."""
    from PIL import Image

    (tmp_path / "sizednets.py").write_text(SIZED)
    rng = np.random.default_rng(0)
    for k, name in enumerate(("blue", "green", "red")):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 60, (12, 12, 3))
            pixels[..., 2 - k] += 180
            Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / "images" / name / f"{i:02d}.png")
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (12, 12)).astype(np.uint8), "L").save(
            tmp_path / "images" / "red" / f"g{i}.png")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "sizednets", raising=False)
    yield tmp_path
    sys.modules.pop("sizednets", None)


def test_convert_says_the_images_it_uses_and_what_a_reader_of_its_numbers_must_know(folder, capsys):
    assert main(CONVERT + ["--limit", "4", "--out", "r"]) == 0
    out, err = capsys.readouterr()
    # the plan: the size of the images, as they are
    assert "data: images, 26 training and 4 test images of 3x12x12 (C x H x W), as they are in the folder " \
           "(--image-size N resizes them)" in out
    # the model records 16 px: said, with the flag that fixes it
    assert "warning: --model sizednets:build records an input size of 16x16 (model.image_size), but the " \
           "images of --data images are 12x12" in err and "give --image-size 16" in err
    # gray and colour: said once, with the count
    assert err.count("mixes grayscale and colour images") == 1
    assert "3 of 33 are grayscale; every image is read as RGB (3 channels), those 3 converted" in err
    # a test split of 4 images
    assert "the accuracies of this run were measured on 4 test image(s) of --data images: on fewer than 100" in err
    meta = json.loads((folder / "r" / "meta.json").read_text())
    assert meta["settings"]["test_subset"] == {"images": 4, "of": 7, "drawn": "stratified by class, seed 0"}
    assert meta["settings"]["image_size"] == [12, 12]
    evaluation = json.loads((folder / "r" / "evaluation.json").read_text())
    assert evaluation["test_subset"]["images"] == 4
    # resized to the recorded size: no warning about it
    assert main(CONVERT + ["--image-size", "16", "--out", "s", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "records an input size" not in err and "measured on 7 test image(s)" in err


def test_limit_keeps_the_classes_shares():
    from torch.utils.data import TensorDataset

    y = torch.tensor([0] * 60 + [1] * 30 + [2] * 10)  # class-sorted, as an image folder is
    data = TensorDataset(torch.zeros(100, 1), y)
    cut = stratified_subset(data, 10, seed=0)
    assert sorted(labels_of(cut)) == [0] * 6 + [1] * 3 + [2]
    assert cut.indices == stratified_subset(data, 10, seed=0).indices  # seeded
    assert cut.indices != list(range(10))
    assert len(stratified_subset(data, 7).indices) == 7 and len(stratified_subset(data, 500).indices) == 100


def test_an_image_folder_knows_its_labels_without_reading_the_images(folder):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, test = image_folder(folder / "images")
    assert [str(w.message).count("grayscale") > 0 for w in caught] == [True]
    labels = labels_of(test)
    assert labels == [test[i][1] for i in range(len(test))]


def test_an_interrupted_overwrite_leaves_the_old_run_as_it_was(folder, capsys, monkeypatch):
    assert main(CONVERT + ["--out", "r", "--quiet"]) == 0
    before = {f: (folder / "r" / f).read_bytes() for f in os.listdir(folder / "r")}
    assert {"ann.pt", "snn.pt", "meta.json"} <= set(before)
    import snnconv.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(snnconv.pipeline, "convert", interrupted)  # Ctrl-C after the new ann.pt
    assert main(CONVERT + ["--out", "r", "--overwrite", "--quiet"]) == 130
    assert {f: (folder / "r" / f).read_bytes() for f in os.listdir(folder / "r")} == before
    assert [p for p in os.listdir(folder) if p.startswith(".")] == []  # nothing staged is left


def test_run_uses_the_data_and_image_size_the_run_recorded_and_names_a_mismatch(folder, capsys):
    """``run RUN`` without ``--data`` reads the folder and the image size the conversion used
    (from anywhere); other images are exit 2 naming their size and channels and the flag to give."""
    assert main(CONVERT + ["--image-size", "16", "--out", "r", "--quiet"]) == 0
    assert main(["export", "r", "--quiet"]) == 0
    capsys.readouterr()
    os.chdir(folder / "r")  # the run's folder is found whatever the current directory
    assert main(["run", ".", "--backend", "cpu", "--T", "2", "--quiet"]) == 0
    rec = json.loads(next((folder / "r" / "backends").glob("cpu_*.json")).read_text())
    assert rec["data"] == str(folder / "images") and rec["settings"]["image_size"] == 16
    assert main(["run", ".", "--backend", "cpu", "--T", "2", "--data", str(folder / "images")]) == 2
    err = capsys.readouterr().err
    assert "the images of --data" in err and "are 12x12 px with 3 channel(s)" in err
    assert "converted for 16x16 px with 3 channel(s)" in err and "give --image-size 16" in err
    assert "Traceback" not in err and sum(line.startswith("snnconv run: error") for line in err.splitlines()) == 1
    assert main(["run", ".", "--backend", "cpu", "--T", "2", "--data", "digits"]) == 2
    err = capsys.readouterr().err
    assert "8x8 px with 1 channel(s)" in err and "images with 3 channel(s), not 1" in err
