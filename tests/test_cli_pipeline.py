"""The CLI end to end on real data (digits): convert -> finetune -> export -> run -> report,
the report checked in headless Chromium; ``--help`` and exit codes of every command."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from _pagetext import visible_text

from snnconv.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREENSHOT = os.path.join(ROOT, "runs", "report-screenshot.png")
COMMANDS = ["demo", "convert", "finetune", "evaluate", "calibrate-exit", "diagnose", "export", "inspect", "run",
            "check", "report", "backends"]
HAS_NIR_AND_BACKENDS = all(importlib.util.find_spec(m) is not None
                           for m in ("snnconv.snn.nir_io", "snnconv.backends"))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _check_the_page_text(run_dir: str, text: str) -> None:
    """The headline and the counts of the report, as the browser shows them, against the run's files."""
    meta = json.load(open(os.path.join(run_dir, "meta.json")))
    ft = json.load(open(os.path.join(run_dir, "finetune.json")))
    acc, n = meta["accuracy"], meta["settings"]["eval_images"]
    assert n == 449  # the digits test split: every accuracy comes with its count
    assert (f"small_cnn on digits, converted to a spiking network at T=4: ANN {acc['ann']:.2f}% \u2192 "
            f"SNN {acc['snn']['4']:.2f}% on 449 test images.") in text
    steps = meta["settings"]["budget"]["finetune_steps_run"]
    assert re.search(rf"Conversion cost: [\d.]+ (s|min \d\d s) on cpu; [\d,]+ parameters; training steps: "
                     rf"QCFS training \d+, BPTT fine-tuning {steps:,} \(unrolled over T=2, 4, 8\)\.", text), text[:600]
    assert (f"After snnconv finetune (trained for T=4, 1 epoch(s)): SNN {ft['accuracy']['snn']['4']:.2f}% at "
            f"T=4 on 449 test images.") in text
    for t in ("1", "2", "4"):
        assert f"SNN (converted) {t} 449 {acc['snn'][t]:.2f}" in text
    # both fine-tuning histories: convert's (meta.json) and snnconv finetune's
    assert f"BPTT in snnconv convert: {steps:,} steps unrolled over T=2, 4, 8;" in text
    assert "BPTT in snnconv finetune: trained for T=4, 1 epoch(s)" in text
    assert "Firing rate per layer (snn_finetuned.pt, T=4, the first 64 test images)" in text
    if HAS_NIR_AND_BACKENDS:
        assert "backend cpu (digits) (a subset: 128 of 449) 4 128" in text
        assert "backend cpu (digits) (few images) 4 4" in text
        assert "Left off the plot (fewer than 100 images, against 449 for the others): cpu (digits) at T=4" in text


def _subcommands() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_every_command_exists_and_its_help_shows_an_example(capsys):
    subs = _subcommands()
    assert sorted(subs) == sorted(COMMANDS)
    for name in COMMANDS:
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert f"example:\n  snnconv {name}" in text, name
        assert "--quiet" in text and "--out" in text, name  # the shared flags


def test_usage_and_input_errors_exit_2_with_one_line_and_no_traceback(tmp_path, capsys):
    cases = [
        ["convert", "--T", "x"],                                  # argparse
        ["convert", "--data", "digits", "--quiet"],               # neither --weights nor --train-epochs
        ["report", str(tmp_path / "missing")],                    # no such run folder
        ["evaluate", str(tmp_path / "none.pt"), "--quiet"],       # no such file
        ["convert", "--model", "nonet", "--train-epochs", "1", "--quiet"],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"snnconv {argv[0]}: error: "), (argv, err)
    # the installed entry point behaves the same in a fresh process
    proc = subprocess.run([sys.executable, "-m", "snnconv.cli", "report", str(tmp_path / "missing")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_convert_flags_default_to_what_convert_chooses():
    parse = build_parser().parse_args
    base = ["convert", "--model", "small_cnn", "--data", "digits", "--train-epochs", "1"]
    args = parse(base)
    assert args.per_channel is None and args.qcfs_epochs is None  # convert() decides
    assert args.reconstruction_steps is None
    assert parse(base + ["--reconstruction-steps", "0"]).reconstruction_steps == 0
    assert parse(base + ["--per-layer"]).per_channel is False
    assert parse(base + ["--per-channel"]).per_channel is True
    assert parse(base + ["--qcfs-epochs", "0"]).qcfs_epochs == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder made by the CLI on scikit-learn digits: convert, then fine-tune."""
    out = str(tmp_path_factory.mktemp("cli") / "run")
    assert main(["convert", "--model", "small_cnn", "--data", "digits", "--train-epochs", "8",
                 "--qcfs-epochs", "1", "--L", "4", "--T", "1", "2", "4", "--out", out, "--quiet"]) == 0
    assert main(["finetune", out, "--model", "small_cnn", "--data", "digits", "--T", "2", "4", "--train-T", "4",
                 "--epochs", "1", "--max-steps", "6", "--quiet"]) == 0
    return out


def test_finetune_without_epochs_takes_convert_s_default_budget(run_dir, tmp_path):
    """``snnconv finetune`` without ``--epochs`` runs the epochs convert() would
    (:func:`snnconv.pipeline.default_finetune_epochs` over the same training loader)."""
    from snnconv.cli import build_parser
    from snnconv.cli.common import loaders
    from snnconv.pipeline import default_finetune_epochs

    argv = ["finetune", run_dir, "--model", "small_cnn", "--data", "digits", "--T", "4", "--max-steps", "2",
            "--out", str(tmp_path / "ft"), "--quiet"]
    assert main(argv) == 0
    ft = json.load(open(tmp_path / "ft" / "finetune.json"))
    want = default_finetune_epochs(loaders(build_parser().parse_args(argv))[0])
    assert ft["epochs"] == len(ft["history"]) == want > 1


def test_convert_and_finetune_write_the_run_folder(run_dir):
    for name in ("ann.pt", "snn.pt", "meta.json", "evaluation.json", "snn_finetuned.pt", "finetune.json",
                 "accuracy_vs_T.png"):
        assert os.path.getsize(os.path.join(run_dir, name)) > 0, name
    meta = json.load(open(os.path.join(run_dir, "meta.json")))
    assert set(meta["accuracy"]["snn"]) == {"1", "2", "4"}
    assert meta["accuracy"]["ann"] > 50  # digits are learnt in 8 epochs (about 97%)
    assert meta["settings"]["per_channel"] is True  # convert()'s default, not a CLI default of its own
    ft = json.load(open(os.path.join(run_dir, "finetune.json")))
    assert len(ft["history"]) == 1 and set(ft["accuracy"]["snn"]) == {"2", "4"}
    # convert()'s recipe, distilled from the run folder's ann.pt (--model names its architecture)
    assert ft["config"]["distill"] == 0.5 and ft["config"]["T"] == 8
    assert tuple(ft["config"]["horizons"]) == (2, 4, 8) and ft["config"]["keep_start"]
    assert main(["evaluate", run_dir, "--data", "digits", "--T", "4", "--limit", "64", "--quiet"]) == 0


def test_export_run_report_and_the_page_in_chromium(run_dir):
    if HAS_NIR_AND_BACKENDS:
        nir_file = os.path.join(run_dir, "snn.nir")
        assert main(["export", run_dir, "--out", nir_file, "--quiet"]) == 0
        assert main(["inspect", nir_file]) == 0
        assert main(["backends"]) == 0
        import snnconv.backends

        ready = snnconv.backends.available()
        for backend in ("cpu", "loihi2-sim"):
            argv = ["run", nir_file, "--backend", backend, "--data", "digits", "--T", "4", "--limit", "128",
                    "--out", run_dir, "--quiet"]
            if ready.get(backend, (False, ""))[0]:
                assert main(argv) == 0, backend
                rec = json.load(open(os.path.join(run_dir, "backends", f"{backend}_T4_digits_128img.json")))
                assert rec["images"] == 128 and 0 <= rec["accuracy"] <= 100
            else:  # not in this build or not usable here: refused by name, never faked
                assert main(argv) == 2, backend
        # a later run on 4 images is kept beside the 128-image result, never over it
        assert main(["run", nir_file, "--backend", "cpu", "--data", "digits", "--T", "4", "--limit", "4",
                     "--out", run_dir, "--quiet"]) == 0
        cpu = json.load(open(os.path.join(run_dir, "backends", "cpu_T4_digits_128img.json")))
        assert cpu["agreement"] == 100.0 and cpu["images"] == 128
        assert json.load(open(os.path.join(run_dir, "backends", "cpu_T4_digits_4img.json")))["images"] == 4
    else:  # the slots say what is missing instead of pretending
        assert main(["export", run_dir, "--quiet"]) == 2
        assert main(["run", "x.nir", "--quiet"]) == 2

    assert main(["report", run_dir, "--quiet"]) == 0
    page_path = os.path.join(run_dir, "report.html")
    page = open(page_path, encoding="utf-8").read()
    n_plots = len(re.findall(r'<img class="plot"', page))
    assert n_plots >= 6

    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium here (make test installs Debian's chromium when run as root)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(flags + ["--virtual-time-budget=5000", "--dump-dom", f"file://{page_path}"],
                         capture_output=True, text=True, timeout=120).stdout
    assert f'data-plots="{n_plots}/{n_plots}"' in dom  # every embedded PNG decoded, width > 0
    _check_the_page_text(run_dir, visible_text(dom))
    os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
    if os.path.exists(SCREENSHOT):
        os.unlink(SCREENSHOT)
    subprocess.run(flags + ["--window-size=1100,4800", f"--screenshot={SCREENSHOT}", f"file://{page_path}"],
                   capture_output=True, timeout=120)
    from PIL import Image

    with Image.open(SCREENSHOT) as img:
        lo, hi = img.convert("L").getextrema()
        colours = len(img.convert("RGB").getcolors(maxcolors=1 << 20) or [])
    assert hi - lo > 100 and colours > 50  # not a blank page
