"""Every command, given bad input: exit 2 and exactly one line on stderr, ``snnconv CMD: error:
...``, with no traceback and no terminal escape codes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from snnconv.cli import main
from snnconv.models import small_cnn
from snnconv.snn.nir_io import export_nir, save_nir

pytestmark = pytest.mark.portable  # CI runs it at the floor and the newest releases too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def files(small_digits_snn, tmp_path):
    """Good and bad inputs: a NIR file, an SNN, a whole pickled module, garbage, an empty folder."""
    f = {"dir": tmp_path / "empty", "nir": tmp_path / "snn.nir", "snn": tmp_path / "snn.pt",
         "module": tmp_path / "module.pt", "garbage": tmp_path / "garbage.pt",
         "garbage_nir": tmp_path / "garbage.nir", "missing": tmp_path / "missing.nir"}
    f["dir"].mkdir()
    save_nir(export_nir(small_digits_snn), f["nir"])
    small_digits_snn.save(f["snn"])
    torch.save(small_cnn(), f["module"])
    f["garbage"].write_bytes(b"not a torch file " * 10)
    f["garbage_nir"].write_bytes(b"not an HDF5 file " * 10)
    return {k: str(v) for k, v in f.items()}


#: (argv with {placeholders} from ``files``, a phrase the error must hold)
CASES = [
    (["demo", "--seed", "x"], "argument --seed"),
    (["convert", "--limit", "-5", "--train-epochs", "1"], "argument --limit: expected an integer >= 1, got '-5'"),
    (["convert", "--model", "small_cnn", "--train-epochs", "-1"], "argument --train-epochs"),
    (["convert", "--model", "small_cnn", "--batch-size", "0", "--train-epochs", "1"], "--batch-size"),
    (["convert", "--model", "small_cnn", "--weights", "{module}", "--quiet"], "holds pickled Python objects"),
    (["convert", "--weights", "{module}", "--quiet"], "give --model NAME"),
    (["convert", "--model", "small_cnn", "--weights", "{dir}", "--quiet"], "is a folder"),
    (["convert", "--model", "small_cnn", "--weights", "{garbage}", "--quiet"], "cannot read"),
    (["finetune", "{dir}", "--quiet"], "holds no snn.pt"),
    (["finetune", "{snn}", "--epochs", "-1"], "argument --epochs"),
    (["finetune", "{garbage}", "--quiet"], "cannot read"),
    (["evaluate", "{dir}", "--quiet"], "holds no snn.pt"),
    (["evaluate", "{garbage}", "--quiet"], "cannot read"),
    (["evaluate", "{snn}", "--T", "0"], "argument --T"),
    (["evaluate", "{snn}", "--limit", "-5"], "argument --limit"),
    (["check", "{module}"], "give --model NAME"),
    (["check", "{garbage}", "--model", "small_cnn"], "cannot read"),
    (["check", "{dir}", "--model", "small_cnn"], "is a folder"),
    (["check"], "give PATH"),
    (["report", "{missing}"], ""),
    (["export", "{garbage}"], "cannot read"),
    (["export", "{dir}"], "holds no snn.pt"),
    (["export", "{snn}", "--input-shape", "a,b"], "is not like 3,32,32"),
    (["inspect", "{dir}"], "is a folder without snn.nir"),
    (["inspect", "{garbage_nir}"], ""),
    (["inspect", "{missing}"], "does not exist"),
    (["run", "{nir}", "--limit", "-5"], "argument --limit: expected an integer >= 1, got '-5'"),
    (["run", "{dir}"], "is a folder without snn.nir; give a NIR file"),
    (["run", "{garbage_nir}"], ""),
    (["run", "{nir}", "--batch", "0"], "argument --batch"),
    (["run", "{nir}", "--T", "-1"], "argument --T"),
    (["run", "{nir}", "--backend", "nope"], "unknown backend 'nope'"),
    (["backends", "--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv, phrase", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_input_is_one_plain_line_on_stderr_and_exit_2(files, argv, phrase, capsys):
    argv = [a.format(**files) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"snnconv {argv[0]}: error: ") and phrase in err, err
    assert "Traceback" not in err and "\x1b[" not in err


def test_flags_a_command_lacks_are_never_suggested(files, capsys):
    assert main(["convert", "--model", "small_cnn", "--weights", files["module"], "--quiet"]) == 2
    assert main(["convert", "--weights", files["module"], "--quiet"]) == 2
    assert "--trust-pickle" not in capsys.readouterr().err  # convert has no such flag
    assert main(["check", files["module"]]) == 2
    assert "--trust-pickle" in capsys.readouterr().err      # check has


def test_the_entry_point_prints_one_line_in_a_fresh_process(files):
    """The installed command: a whole pickled module as --weights (torch's own message is long,
    with escape codes) and a negative --limit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "backends")])}
    for argv in (["convert", "--model", "small_cnn", "--weights", files["module"], "--quiet"],
                 ["run", files["nir"], "--limit", "-5"]):
        proc = subprocess.run([sys.executable, "-m", "snnconv.cli", *argv], capture_output=True,
                              text=True, env=env)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and "\x1b[" not in proc.stderr


# --- progress of a long run (snnconv run: lava takes seconds per image) ----------------------

def _lines_after(buf, n: int) -> list[str]:
    """Once ``buf`` holds more than ``n`` lines (a guard against a hang, not a time bound)."""
    import time

    for _ in range(100000):
        lines = buf.getvalue().splitlines()
        if len(lines) > n:
            return lines
        time.sleep(0.01)
    pytest.fail("no progress line came")


def test_a_long_run_says_how_long_it_will_take_and_shows_progress_until_it_ends():
    import io
    import time

    from snnconv.cli.common import Heartbeat

    buf = io.StringIO()
    with Heartbeat("snnconv run (lava)", total=48, interval=0.01, file=buf) as beat:
        time.sleep(0.05)  # the first batch: longer than the interval
        beat.update(16)
        lines = _lines_after(buf, 0)
        estimate = next(line for line in lines if "the first" in line)
        assert re.fullmatch(r"snnconv run \(lava\): the first 16 images took [\d.]+ s: about [\d.]+ s "
                            r"for all 48 \(--limit N runs fewer\)", estimate)
        start = len(buf.getvalue().splitlines())
        beat_line = _lines_after(buf, start)[start]
        assert re.fullmatch(r"snnconv run \(lava\): 16/48 images, [\d.]+ s elapsed, about [\d.]+ s left",
                            beat_line)
    ended = len(buf.getvalue().splitlines())
    time.sleep(0.05)
    assert len(buf.getvalue().splitlines()) == ended  # no line once the run is over


def test_quiet_silences_the_progress():
    import io
    import time

    from snnconv.cli.common import Heartbeat

    buf = io.StringIO()
    with Heartbeat("snnconv run (lava)", total=48, interval=0.01, file=buf, quiet=True) as beat:
        time.sleep(0.05)
        beat.update(16)
        time.sleep(0.05)
    assert buf.getvalue() == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", [["demo"], ["evaluate", "nowhere"], ["convert", "--model", "small_cnn",
                                                                          "--train-epochs", "1"]])
def test_a_cuda_device_on_a_machine_without_one_is_a_usage_error(command, capsys):
    assert main(command + ["--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU is visible here" in err and "--device cpu" in err
    assert main(command + ["--device", "tpu:0", "--quiet"]) == 2
