"""``snnconv check``: exit 1 listing BatchNorms, 0 when clean or folded, 2 when refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from snnconv import models
from snnconv.cli import main

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too


@pytest.fixture
def resnet8_state(tmp_path):
    path = tmp_path / "resnet8.pt"
    torch.save(models.get("resnet8").state_dict(), path)
    return path


def test_check_of_a_state_dict_with_batchnorm_exits_1_listing_them(resnet8_state, capsys):
    assert main(["check", str(resnet8_state), "--model", "resnet8"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
               for m in models.get("resnet8").modules())
    assert f"{n_bn} BatchNorm(s) remain" in out
    assert "module 'bn1': BatchNorm2d" in out
    assert "module 'layers.1.0.shortcut.1': BatchNorm2d" in out


def test_check_with_fold_exits_0(resnet8_state, capsys):
    assert main(["check", str(resnet8_state), "--model", "resnet8", "--fold"]) == 0
    assert "ok" in capsys.readouterr().out


def test_check_reads_a_checkpoint_dict_holding_a_state_dict(tmp_path, capsys):
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "state_dict": models.get("small_cnn", in_channels=1).state_dict()}, path)
    assert main(["check", str(path), "--model", "small_cnn", "--in-channels", "1", "--fold"]) == 0


def test_check_of_a_state_dict_for_another_model_exits_2(resnet8_state, capsys):
    assert main(["check", str(resnet8_state), "--model", "resnet14"]) == 2
    assert "does not fit model 'resnet14'" in capsys.readouterr().err


def test_check_zoo_with_fold_exits_0_for_every_model(capsys):
    assert main(["check", "--zoo", "--fold"]) == 0
    out = capsys.readouterr().out
    for name in models.names():
        assert f"ok   zoo:{name}" in out


def test_check_zoo_lists_the_zoo_as_convert_sees_it(capsys):
    """``--help`` points at ``check --zoo`` for the list of models: it lists them, each checked
    after folding (the zoo's models hold BatchNorm by design), and exits 0."""
    assert main(["check", "--zoo"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "after folding" in out.splitlines()[0]
    for name in models.names():
        assert f"ok   zoo:{name} (" in out and "parameters): no BatchNorm after folding" in out


def test_check_a_pickled_module_needs_trust_pickle(tmp_path, capsys):
    path = tmp_path / "whole.pt"
    torch.save(models.get("small_cnn"), path)
    assert main(["check", str(path)]) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    assert main(["check", str(path), "--model", "small_cnn"]) == 2  # weights_only refuses it
    assert main(["check", str(path), "--trust-pickle"]) == 1
    assert "module 'bn1'" in capsys.readouterr().out
    assert main(["check", str(path), "--trust-pickle", "--fold"]) == 0


def test_check_a_corrupt_pickle_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.pt"
    path.write_bytes(b"\x80\x04 this is not a pickle")
    assert main(["check", str(path), "--trust-pickle"]) == 2
    assert "cannot unpickle" in capsys.readouterr().err


def test_check_of_a_missing_file_or_no_target_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "none.pt"), "--model", "resnet8"]) == 2
    assert main(["check"]) == 2
    assert "--zoo" in capsys.readouterr().err


def test_check_runs_as_the_installed_console_script(resnet8_state):
    script = os.path.join(os.path.dirname(sys.executable), "snnconv")
    result = subprocess.run([script, "check", str(resnet8_state), "--model", "resnet8"],
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "FAIL" in result.stdout and "module 'bn1': BatchNorm2d" in result.stdout
