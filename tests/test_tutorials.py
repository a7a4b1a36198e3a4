"""The tutorial notebooks run top to bottom and leave the files they promise.

Smoke mode (the default suite): CIFAR-shaped data made by the notebook, ResNet-8, a few batches.
The five notebooks run in order in one kernel each (papermill), handing files on through
``out_dir``. It shows that the code runs, not what conversion does.

Real-data mode (deselected by default; 35 minutes on 2 shared CPU cores)::

    pytest -m realdata tests/test_tutorials.py

Fashion-MNIST at 3x32x32 from Debian's dataset-fashion-mnist, ResNet-8 trained for 5 epochs on
10,000 images, converted at T=4 with convert()'s defaults: the ANN reaches at least 80% on the
first 2,000 test images and the fine-tuned SNN at T=4 comes within 5 points of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import needs_fashion

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIALS = os.path.join(os.path.dirname(HERE), "tutorials")
NOTEBOOKS = ["01_train_resnet18_cifar10", "02_convert", "03_finetune_bptt", "04_nir_and_backends",
             "05_analysis"]
HAS_NIR_AND_BACKENDS = all(importlib.util.find_spec(m) is not None
                           for m in ("snnconv.snn.nir_io", "snnconv.backends"))

papermill = pytest.importorskip("papermill", reason="papermill is in the test extra (pip install -e .[test])")


#: The parameters of the real-data run (the command the notebooks' first cells quote).
FASHION = {"dataset": "fashion_mnist", "train_limit": 10000, "test_limit": 2000}
FASHION_01 = {"model_name": "resnet8", "epochs": 5, "batch_size": 64, "lr": 0.05}


def _execute(name: str, out_dir: str, executed_dir: str, **params) -> dict:
    """Run one notebook (smoke mode unless ``params`` say otherwise); return it executed (JSON)."""
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
            plain = o.get("data", {}).get("text/plain", "")
            out.append("".join(o.get("text", "")) if "text" in o else json.dumps(plain))
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


def test_notebooks_import_only_the_public_api():
    """The notebooks teach what users can import: snnconv's public names and modules, never the
    backends' internals or private helpers."""
    import snnconv

    for name in NOTEBOOKS:
        with open(os.path.join(TUTORIALS, f"{name}.ipynb"), encoding="utf-8") as fh:
            source = "\n".join(c["source"] for c in json.load(fh)["cells"] if c["cell_type"] == "code")
        assert "snnconv_backends" not in source, name
        assert "atomic_write" not in source, name
        for module, names in re.findall(r"^from (snnconv\S*) import (.+)$", source, re.M):
            for imported in (n.strip().split(" as ")[0] for n in names.split(",")):
                assert not imported.startswith("_"), (name, module, imported)
                if module == "snnconv":
                    assert imported in snnconv.__all__ or importlib.util.find_spec(f"snnconv.{imported}"), \
                        (name, imported)
                else:
                    assert imported in importlib.import_module(module).__all__, (name, module, imported)


def _run_all(out: str, executed: str, **params) -> dict[str, dict]:
    """Run the five notebooks in order with ``params``; the executed notebooks by name."""
    runs = {}
    for name in NOTEBOOKS:
        if name == "04_nir_and_backends" and not HAS_NIR_AND_BACKENDS:
            with pytest.raises(papermill.PapermillExecutionError, match="lacks"):
                _execute(name, out, executed, **params)
            continue
        own = FASHION_01 if name.startswith("01") and params.get("dataset") == "fashion_mnist" else {}
        start = time.perf_counter()
        runs[name] = _execute(name, out, executed, **params, **own)
        print(f"{name} ({params.get('dataset', 'smoke')}): {time.perf_counter() - start:.0f} s")
    return runs


def _read(out: str, name: str) -> dict:
    with open(os.path.join(out, name), encoding="utf-8") as fh:
        return json.load(fh)


def test_notebooks_run_in_smoke_mode_and_hand_their_files_on(tmp_path):
    from snnconv import SpikingNetwork, find_batchnorm

    out = str(tmp_path / "run")
    executed = tmp_path / "executed"
    executed.mkdir()
    runs = _run_all(out, str(executed))

    info = _read(out, "ann.json")
    # smoke mode trains enough for its plots to show something: far above chance (10%)
    assert info["model"] == "resnet8" and 40.0 <= info["test_accuracy"] <= 100.0
    state = torch.load(os.path.join(out, "ann.pt"), weights_only=True)
    assert any("bn" in k for k in state)  # the ANN is trained with BatchNorm

    text = _text(runs["02_convert"])
    assert "refused, as expected" in text
    assert "per channel (default)" in text and "per layer" in text  # the comparison ran
    meta = _read(out, "meta.json")
    # convert()'s defaults, but for the one setting the notebook names
    assert meta["settings"]["per_channel"] is True and meta["settings"]["finetune_epochs"] == 0
    acc = meta["accuracy"]
    assert set(acc) >= {"ann", "folded", "qcfs", "snn"} and set(acc["snn"]) == {"1", "2", "4", "8"}
    assert all(0.0 <= a <= 100.0 for a in acc["snn"].values())
    assert acc["snn"]["4"] > 25.0  # conversion working shows in the smoke run (chance: 10%)
    assert abs(acc["ann"] - acc["folded"]) < 1.0  # folding keeps the function
    snn = SpikingNetwork.load(os.path.join(out, "snn.pt"))
    assert find_batchnorm(snn) == []

    text = _text(runs["03_finetune_bptt"])
    assert "is the recipe convert() used: True" in text
    ft = _read(out, "finetune.json")
    # convert()'s recipe: 2T steps unrolled, readouts at T/2, T, 2T, distilled from the ANN
    assert ft["config"]["T"] == 8 and ft["config"]["horizons"] == [2, 4, 8] and ft["config"]["distill"] > 0
    assert len(ft["history"]) == 2 and set(ft["accuracy"]["snn"]) == {"1", "2", "4", "8"}
    assert find_batchnorm(SpikingNetwork.load(os.path.join(out, "snn_finetuned.pt"))) == []

    if HAS_NIR_AND_BACKENDS:
        assert os.path.getsize(os.path.join(out, "snn.nir")) > 0
        cpu = _read(out, os.path.join("backends", "cpu.json"))
        assert cpu["agreement"] == 100.0  # the reference executor is exact

    ev = _read(out, "evaluation.json")
    rates = ev["analysis"]["firing_rate"]
    assert rates and all(0.0 <= r <= 1.0 for r in rates.values())
    assert ev["analysis"]["energy"]["ann_pj"] > 0
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert page.count("data:image/png;base64,") >= 5

    # readable output: no JSON dumps, every energy with its unit, no long unrounded numbers
    for name, nb in runs.items():
        text = _text(nb)
        assert "not reported" not in text and '{"' not in text, name
        assert not re.search(r"\d+\.\d{7,}", text), (name, re.search(r".*\d+\.\d{7,}.*", text).group())


@pytest.mark.realdata
@needs_fashion
def test_notebooks_on_fashion_mnist_keep_the_anns_accuracy_at_T4(tmp_path):
    """The real-data run: the ANN reaches 80% and the SNN at T=4 comes within 5 points of it."""
    out = str(tmp_path / "run")
    executed = tmp_path / "executed"
    executed.mkdir()
    _run_all(out, str(executed), **FASHION)

    ann = _read(out, "ann.json")["test_accuracy"]
    snn = _read(out, "finetune.json")["accuracy"]["snn"]
    print(f"Fashion-MNIST 3x32x32: ANN {ann:.2f}%, SNN by T {snn}")
    assert ann >= 80.0
    assert snn["4"] >= ann - 5.0
