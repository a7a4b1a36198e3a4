"""The tutorial notebooks run top to bottom in smoke mode and leave the files they promise.

Smoke mode: CIFAR-shaped data made by the notebook, ResNet-8, a few batches, T <= 4. The five
notebooks run in order in one kernel each (papermill), handing files on through ``out_dir``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIALS = os.path.join(os.path.dirname(HERE), "tutorials")
NOTEBOOKS = ["01_train_resnet18_cifar10", "02_convert", "03_finetune_bptt", "04_nir_and_backends",
             "05_analysis"]
HAS_NIR_AND_BACKENDS = all(importlib.util.find_spec(m) is not None
                           for m in ("snnconv.nir_io", "snnconv.backends"))

papermill = pytest.importorskip("papermill", reason="papermill is in the test extra (pip install -e .[test])")


def _execute(name: str, out_dir: str, executed_dir: str, **params) -> dict:
    """Run one notebook in smoke mode; return the executed notebook (JSON)."""
    src = os.path.join(TUTORIALS, f"{name}.ipynb")
    dst = os.path.join(executed_dir, f"{name}.ipynb")
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        papermill.execute_notebook(src, dst, parameters={"dataset": "smoke", "out_dir": out_dir,
                                                         "device": "cpu", **params},
                                   kernel_name="python3", cwd=executed_dir, progress_bar=False,
                                   log_output=False)
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    with open(dst, encoding="utf-8") as fh:
        return json.load(fh)


def _text(nb: dict) -> str:
    out = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            out.append("".join(o.get("text", "")) if "text" in o else json.dumps(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def test_notebooks_are_committed_without_outputs_and_match_their_generator():
    proc = subprocess.run([sys.executable, os.path.join(TUTORIALS, "build_notebooks.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in NOTEBOOKS:
        with open(os.path.join(TUTORIALS, f"{name}.ipynb"), encoding="utf-8") as fh:
            nb = json.load(fh)
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), name
        tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
        assert len(tagged) == 1 and tagged[0]["source"].startswith("dataset = "), name


def test_notebooks_run_in_smoke_mode_and_hand_their_files_on(tmp_path):
    from snnconv import SpikingNetwork, find_batchnorm

    out = str(tmp_path / "run")
    executed = tmp_path / "executed"
    executed.mkdir()

    _execute("01_train_resnet18_cifar10", out, str(executed))
    info = json.loads(open(os.path.join(out, "ann.json")).read())
    # smoke mode trains enough for its plots to show something: far above chance (10%)
    assert info["model"] == "resnet8" and 40.0 <= info["test_accuracy"] <= 100.0
    state = torch.load(os.path.join(out, "ann.pt"), weights_only=True)
    assert any("bn" in k for k in state)  # the ANN is trained with BatchNorm

    nb = _execute("02_convert", out, str(executed))
    assert "refused, as expected" in _text(nb)
    meta = json.loads(open(os.path.join(out, "meta.json")).read())
    acc = meta["accuracy"]
    assert set(acc) >= {"ann", "folded", "qcfs", "snn"} and set(acc["snn"]) == {"1", "2", "4"}
    assert all(0.0 <= a <= 100.0 for a in acc["snn"].values())
    assert acc["snn"]["4"] > 25.0  # conversion working shows in the smoke run (chance: 10%)
    assert abs(acc["ann"] - acc["folded"]) < 1.0  # folding keeps the function
    snn = SpikingNetwork.load(os.path.join(out, "snn.pt"))
    assert find_batchnorm(snn) == []

    _execute("03_finetune_bptt", out, str(executed))
    ft = json.loads(open(os.path.join(out, "finetune.json")).read())
    assert len(ft["history"]) == 1 and set(ft["accuracy"]["snn"]) == {"1", "2", "4"}
    assert find_batchnorm(SpikingNetwork.load(os.path.join(out, "snn_finetuned.pt"))) == []

    if HAS_NIR_AND_BACKENDS:
        _execute("04_nir_and_backends", out, str(executed))
        assert os.path.getsize(os.path.join(out, "snn.nir")) > 0
        cpu = json.loads(open(os.path.join(out, "backends", "cpu.json")).read())
        assert cpu["agreement"] == 100.0  # the reference executor is exact
    else:
        with pytest.raises(papermill.PapermillExecutionError, match="lacks"):
            _execute("04_nir_and_backends", out, str(executed))

    _execute("05_analysis", out, str(executed))
    ev = json.loads(open(os.path.join(out, "evaluation.json")).read())
    rates = ev["analysis"]["firing_rate"]
    assert rates and all(0.0 <= r <= 1.0 for r in rates.values())
    assert ev["analysis"]["energy"]["ann_pj"] > 0
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert page.count("data:image/png;base64,") >= 5
