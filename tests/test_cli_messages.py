"""What the command line says where a newcomer goes wrong: each message names what was found,
where, and what to do, with its exit code; and a user's own model (``--model
package.module:factory``) and images (``--data DIR``) end to end."""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch

from snnconv.cli import main

#: A user's module: a factory of a small BN CNN for 3-channel images, and things that are not.
TINYNETS = '''
import torch.nn as nn


def build():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))


def any_size():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def not_a_module():
    return 42


def broken():
    raise RuntimeError("no weights here")
'''


def _one_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"snnconv {command}: error: "), err
    return err


@pytest.fixture
def run_folder(small_digits_snn, tmp_path):
    """A run folder holding a saved SNN and a meta.json."""
    folder = tmp_path / "run"
    folder.mkdir()
    small_digits_snn.save(folder / "snn.pt")
    (folder / "meta.json").write_text(json.dumps({"settings": {"T": 4}}))
    return folder


def test_evaluate_quiet_writes_its_record_beside_the_network_and_says_where(run_folder, capsys):
    assert main(["evaluate", str(run_folder), "--data", "digits", "--T", "2", "4", "--limit", "100",
                 "--quiet"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    path = run_folder / "evaluation.json"
    assert out == [f"wrote {path}: snn.pt at T=2, 4 on 100 images"]
    rec = json.loads(path.read_text())
    assert rec["images"] == 100 and rec["data"] == "digits" and set(rec["accuracy"]) == {"2", "4"}
    assert main(["evaluate", str(run_folder / "snn.pt"), "--data", "digits", "--T", "4", "--limit", "50",
                 "--quiet"]) == 0  # a second record replaces the first, and says so
    assert capsys.readouterr().out.strip() == (f"wrote {path}: snn.pt at T=4 on 50 images (it replaces "
                                               "snn.pt at T=2, 4 on 100 images)")


def test_report_given_a_file_names_the_folder_to_give(run_folder, capsys):
    assert main(["report", str(run_folder / "snn.pt")]) == 2
    err = _one_error(capsys, "report")
    assert f"{run_folder / 'snn.pt'} is a file, not a run folder; give the folder holding it: " \
           f"snnconv report {run_folder}" in err


def test_a_json_file_for_a_network_is_named_for_what_it_is(run_folder, capsys):
    meta = str(run_folder / "meta.json")
    for command in ("export", "evaluate", "finetune"):
        assert main([command, meta, "--quiet"]) == 2
        err = _one_error(capsys, command)
        assert f"{meta} is a JSON file (a run's record), not a saved network" in err
        assert f"give a network file (snn.pt, written by snnconv convert) or its run folder ({run_folder})" in err
        assert "weights_only" not in err
    for command in ("run", "inspect"):  # a network where a NIR file belongs
        assert main([command, str(run_folder / "snn.pt")]) == 2
        err = _one_error(capsys, command)
        assert "is a torch.save file, not a NIR file; give a NIR file (snnconv export" in err


def test_a_missing_dataset_points_at_the_download_flag(tmp_path, capsys):
    empty = str(tmp_path)
    assert main(["convert", "--model", "small_cnn", "--train-epochs", "1", "--data", "fashion_mnist",
                 "--data-root", empty, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = _one_error(capsys, "convert")
    assert f"Fashion-MNIST train files not found in {empty}" in err
    assert "give --download (with --data-root DIR: where the files go)" in err
    assert "fashion_mnist(root=DIR" not in err
    assert not (tmp_path / "r").exists()


def test_an_unknown_model_is_said_first_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "runs" / "convert"
    assert main(["convert", "--model", "resnet50", "--train-epochs", "1", "--out", str(out), "--quiet"]) == 2
    err = _one_error(capsys, "convert")
    assert "--model resnet50: no such zoo model (the zoo: resnet14, resnet18, resnet20, resnet8," in err
    assert "give your own as --model package.module:factory" in err
    assert "torchvision's is --model torchvision.models:resnet50" in err
    assert "--weights" not in err
    assert not out.exists() and not out.parent.exists()
    # a known model without weights: the advice, and still no folder
    assert main(["convert", "--model", "small_cnn", "--out", str(out), "--quiet"]) == 2
    assert "give --weights FILE" in _one_error(capsys, "convert") and not out.parent.exists()


def test_help_is_plain_text_and_says_what_the_flags_do(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "``" not in top and "The snnconv command line" in top
    assert main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Adam steps fitting each IF layer" in text and "SGD" not in text
    assert "package.module:factory" in text and "ImageFolder layout" in text and "--image-size N" in text


def test_a_backend_speed_below_one_image_step_per_second_is_not_zero():
    from snnconv.cli.nir import rate_text

    assert rate_text(16, 40.0) == "0.4 image-steps/s"  # Lava: 4 images at T=4 in 40 s
    assert rate_text(51200, 2.0) == "25,600 image-steps/s"


def test_reading_a_nir_file_with_per_channel_scales_warns_nothing(tmp_path):
    """Arrays read from a NIR file are read-only; the network built from them copies them (torch
    warned "The given NumPy array is not writable" on every torchvision ResNet's file)."""
    import nir
    from _nirfiles import tiny_graph

    from snnconv.snn.nir_io import from_nir, load_nir, save_nir

    graph = tiny_graph(hidden=4)
    graph.nodes["shortcut"] = nir.Scale(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    graph.edges = [e for e in graph.edges if e != ("n1_fire", "fc2")] + [("n1_fire", "shortcut"),
                                                                         ("shortcut", "fc2")]
    save_nir(graph, tmp_path / "g.nir")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = from_nir(load_nir(tmp_path / "g.nir"))
    assert net(torch.zeros(1, 3)).shape == (1, 2)


# --- the user's own model and images --------------------------------------------------------

@pytest.fixture
def own(tmp_path, monkeypatch):
    """The current folder holds ``tinynets.py`` and ``images/CLASS/*.png`` (3 classes, 10 each,
    12x12 pixels: one colour per class, with noise); sys.path and sys.modules are restored after."""
    from PIL import Image

    (tmp_path / "tinynets.py").write_text(TINYNETS)
    rng = np.random.default_rng(0)
    for k, name in enumerate(("blue", "green", "red")):
        folder = tmp_path / "images" / name
        folder.mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 60, (12, 12, 3))
            pixels[..., 2 - k] += 180
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i:02d}.png")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "tinynets", raising=False)
    yield tmp_path
    sys.modules.pop("tinynets", None)


def test_convert_export_and_run_a_factory_model_on_an_image_folder(own, capsys):
    common = ["--model", "tinynets:build", "--data", "images", "--image-size", "8", "--batch-size", "8"]
    assert main(["convert", *common, "--train-epochs", "2", "--T", "2", "4", "--finetune-epochs", "0",
                 "--out", "trained", "--quiet"]) == 0
    meta = json.loads((own / "trained" / "meta.json").read_text())
    assert meta["settings"]["model"] == "tinynets:build" and meta["settings"]["data"] == "images"
    assert meta["settings"]["eval_images"] == 6  # one image in five of 30
    assert set(meta["accuracy"]["snn"]) == {"2", "4"}
    # the same factory with a state dict (read weights-only)
    import tinynets

    torch.manual_seed(0)
    torch.save(tinynets.build().state_dict(), own / "weights.pt")
    assert main(["convert", *common, "--weights", "weights.pt", "--T", "2", "--finetune-epochs", "0",
                 "--out", "given", "--quiet"]) == 0
    assert main(["export", "given", "--quiet"]) == 0
    assert main(["run", "given", "--backend", "cpu", "--data", "images", "--image-size", "8", "--quiet"]) == 0
    records = os.listdir(own / "given" / "backends")
    assert len(records) == 1 and records[0].startswith("cpu_T2_images_6img_")
    rec = json.loads((own / "given" / "backends" / records[0]).read_text())
    assert rec["images"] == 6 and rec["agreement"] == 100.0 and rec["settings"] == {"image_size": 8}
    capsys.readouterr()


@pytest.mark.parametrize("argv, phrase", [
    (["--model", "nosuchmodule:build"], "--model nosuchmodule:build: cannot import nosuchmodule "
                                        "(ModuleNotFoundError"),
    (["--model", "tinynets:nothere"], "--model tinynets:nothere: tinynets has no function 'nothere'"),
    (["--model", "tinynets:not_a_module"], "not_a_module() returned a int, not an nn.Module"),
    (["--model", "tinynets:broken"], "broken() raised RuntimeError: no weights here"),
    (["--model", "tinynets:build", "--data", "nofolder"], "argument --data: 'nofolder' is neither a dataset "
                                                           "(digits, fashion_mnist, cifar10, synthetic) nor a folder"),
    (["--model", "tinynets:build", "--data", "digits"], "--model tinynets:build does not take the images of "
                                                         "--data digits (one is 1x8x8): RuntimeError"),
    (["--model", "tinynets:build", "--data", "images", "--num-classes", "5"], "--num-classes shape(s) a zoo "
                                                                              "model; --model tinynets:build builds"),
    (["--model", "small_cnn", "--data", "digits", "--image-size", "8"], "--image-size applies to a folder of "
                                                                          "images (--data DIR)"),
    (["--model", "tinynets:build", "--data", "images", "--weights", "images/red/00.png"],
     "cannot read images/red/00.png as a torch.save file"),
])
def test_the_own_model_and_data_flags_refuse_with_what_to_do(own, argv, phrase, capsys):
    extra = [] if "--weights" in argv else ["--train-epochs", "1"]
    assert main(["convert", *argv, *extra, "--out", "r", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and phrase in err, err
    assert not (own / "r").exists()


def test_images_of_several_sizes_need_an_image_size(own, capsys):
    from PIL import Image

    Image.new("RGB", (20, 16)).save(own / "images" / "red" / "99.png")
    assert main(["convert", "--model", "tinynets:any_size", "--data", "images", "--train-epochs", "1",
                 "--out", "r", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "99.png is 20x16 pixels, the folder's first image 12x12; give an image size (--image-size N" in err
