"""Plots: PNG files written atomically, with the permissions open() would give."""

from __future__ import annotations

import os
import stat

import pytest

from snnconv.analysis.plots import plot_accuracy_vs_T, plot_history


@pytest.mark.parametrize("draw", [
    lambda p: plot_accuracy_vs_T({"snn": {1: 20.0, 2: 40.0, 4: 80.0}}, p, references={"ANN": 90.0}),
    lambda p: plot_history([{"epoch": 1, "loss": 1.0, "train_acc": 60.0, "val_acc": 62.0},
                            {"epoch": 2, "loss": 0.5, "train_acc": 80.0, "val_acc": 79.0}], p),
], ids=["accuracy_vs_T", "history"])
def test_plots_are_pngs_with_the_usual_permissions_and_no_temporary(tmp_path, draw):
    path = tmp_path / "out" / "plot.png"
    path.parent.mkdir()
    path.write_bytes(b"old")
    mask = os.umask(0o022)
    try:
        draw(path)
    finally:
        os.umask(mask)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
    assert os.listdir(path.parent) == ["plot.png"]
