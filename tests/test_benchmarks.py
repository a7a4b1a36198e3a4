"""The benchmarks package: every entry point's ``--tiny`` mode runs and writes its results, and
no benchmark edits ``sys.path``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: entry point -> (file its tiny run writes, keys its JSON has)
TINY = {
    "matrix": ("robustness.json", {"settings", "summary", "records", "errors"}),
    "backends": ("backends.json", {"results", "threads", "clock"}),
    "interop": ("nir_file_limits.json", {"unused", "chain 8"}),
    "coverage": ("coverage.json", {"command", "rows"}),
    "scale": ("scale.json", {"machine", "settings", "cells"}),
    "gpu_check": ("gpu_check.json", {"sections", "errors", "skipped", "throughput"}),
}


def _run(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """The benchmarks' command line in a subprocess; ``timeout`` only guards against a hang (a
    tiny mode takes seconds to a few minutes, more on a loaded machine)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "backends")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("entry", sorted(TINY))
def test_every_entry_point_has_a_tiny_mode_that_writes_its_results(entry, tmp_path):
    proc = _run(entry, "--tiny", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    name, keys = TINY[entry]
    data = json.loads((tmp_path / name).read_text())
    assert keys <= set(data), sorted(data)
    if entry == "matrix":  # the cells as data: one record per job, the cell's SNN at each T asked for
        assert data["errors"] == []
        (record,) = data["records"]
        assert record["arch"] == "small_cnn" and set(record["cells"]) == {"default"}
        assert {"2", "4"} <= set(record["cells"]["default"]["snn"])
        assert (tmp_path / "robustness.png").exists()


def test_the_front_lists_the_entries_and_refuses_an_unknown_one():
    listing = _run("--help", timeout=60)
    assert listing.returncode == 0
    for entry in TINY:
        assert entry in listing.stdout
    assert _run("nonesuch", timeout=60).returncode == 2


def test_an_entry_lists_its_questions_and_runs_one_with_its_own_flags():
    listing = _run("coverage", "--help", timeout=60)
    assert listing.returncode == 0 and "loihi2" in listing.stdout and "classifiers" in listing.stdout
    own = _run("coverage", "loihi2", "--help", timeout=60)
    assert own.returncode == 0
    for flag in ("--threads", "--finetune", "--models", "--out", "--finetuned-only"):
        assert flag in own.stdout


def test_no_benchmark_edits_sys_path():
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "benchmarks").rglob("*.py")
                 if "sys.path" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_pairs_compares_a_lever_with_its_baseline_cell_by_cell(tmp_path):
    """``matrix robustness --pairs``: the same (network, seed, cell) of two sweeps side by side,
    the change at each T, and the plot."""
    def sweep(name, snn):
        record = {"arch": "resnet20", "seed": 0, "cells": {"T4": {"ann": 88.0, "qcfs": 80.0, "seconds": 10.0,
                                                                "snn": snn}}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"records": [record, dict(record, seed=1, cells={})]}))
        return str(path)

    base, lever = sweep("base", {"2": 80.0, "4": 84.0}), sweep("noise", {"2": 81.5, "4": 83.75})
    out = _run("matrix", "robustness", "--pairs", base, lever, "--out", str(tmp_path / "pairs.png"))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| noise | resnet20 | 0 | T4 |")]
    assert len(rows) == 1
    assert "T=2: 80.00 -> 81.50 (+1.50)" in rows[0] and "T=4: 84.00 -> 83.75 (-0.25)" in rows[0]
    assert (tmp_path / "pairs.png").stat().st_size > 0
