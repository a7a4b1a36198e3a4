"""A run folder holds one run: convert refuses a folder that holds one (unless --overwrite, which
removes the old run's files first), and readers refuse a network file of another run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from snnconv.cli import main

CONVERT = ["convert", "--model", "small_cnn", "--data", "digits", "--train-epochs", "1",
           "--finetune-epochs", "0", "--reconstruction-steps", "0", "--limit", "64", "--quiet"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run R: convert at T=2, then fine-tune. Run S elsewhere: another convert (T=4, seed 5)."""
    base = tmp_path_factory.mktemp("runs")
    r, s = str(base / "R"), str(base / "S")
    assert main(CONVERT + ["--T", "2", "--out", r]) == 0
    assert main(["finetune", r, "--data", "digits", "--T", "2", "--train-T", "2", "--epochs", "1",
                 "--max-steps", "2", "--limit", "64", "--quiet"]) == 0
    assert main(CONVERT + ["--T", "4", "--seed", "5", "--out", s]) == 0
    return r, s


def test_convert_into_a_folder_holding_a_run_is_refused(two_runs, capsys):
    r, _ = two_runs
    before = {f: os.path.getmtime(os.path.join(r, f)) for f in os.listdir(r)}
    capsys.readouterr()
    assert main(CONVERT + ["--T", "4", "--seed", "5", "--out", r]) == 2
    err = capsys.readouterr().err
    assert r in err and "--overwrite" in err and "snn_finetuned.pt" in err
    assert {f: os.path.getmtime(os.path.join(r, f)) for f in os.listdir(r)} == before


def test_overwrite_removes_the_old_run_first(two_runs, tmp_path):
    r, _ = two_runs
    copy = str(tmp_path / "R")
    shutil.copytree(r, copy)
    (tmp_path / "R" / "notes.txt").write_text("mine")
    assert main(CONVERT + ["--T", "4", "--seed", "5", "--out", copy, "--overwrite"]) == 0
    assert not os.path.exists(os.path.join(copy, "snn_finetuned.pt"))
    assert not os.path.exists(os.path.join(copy, "finetune"))
    assert (tmp_path / "R" / "notes.txt").read_text() == "mine"  # not the run's: left alone
    assert main(["export", copy, "--quiet"]) == 0
    assert json.load(open(os.path.join(copy, "meta.json")))["settings"]["T"] == 4


def test_an_empty_folder_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    assert main(CONVERT + ["--T", "2", "--out", str(tmp_path / "empty")]) == 0


def test_readers_refuse_a_network_file_left_by_another_run(two_runs, tmp_path, capsys):
    """The old run's fine-tuned network beside a new run's meta.json: export, evaluate and
    finetune name the file instead of using it."""
    r, s = two_runs
    mixed = tmp_path / "mixed"
    shutil.copytree(s, mixed)
    shutil.copy(os.path.join(r, "snn_finetuned.pt"), mixed / "snn_finetuned.pt")
    for argv in (["export", str(mixed)], ["evaluate", str(mixed), "--data", "digits", "--limit", "32"]):
        capsys.readouterr()
        assert main(argv + ["--quiet"]) == 2, argv
        err = capsys.readouterr().err
        assert "snn_finetuned.pt" in err and "another run" in err
    assert not (mixed / "snn.nir").exists()


def test_readers_say_which_file_they_used(two_runs, capsys):
    r, _ = two_runs
    capsys.readouterr()
    assert main(["evaluate", r, "--data", "digits", "--limit", "32", "--T", "2"]) == 0
    assert f"using {os.path.join(r, 'snn_finetuned.pt')}" in capsys.readouterr().out
    ids = {json.load(open(os.path.join(r, f))).get("run_id") or
           json.load(open(os.path.join(r, f)))["settings"]["run_id"]
           for f in ("meta.json", "finetune.json")}
    assert len(ids) == 1 and None not in ids


def test_the_report_leaves_out_files_of_another_run(two_runs, tmp_path):
    r, s = two_runs
    mixed = tmp_path / "mixed"
    shutil.copytree(s, mixed)
    shutil.copy(os.path.join(r, "finetune.json"), mixed / "finetune.json")
    assert main(["report", str(mixed)]) == 0
    page = (mixed / "report.html").read_text()
    assert "Left out finetune.json" in page
