"""Write the tutorial notebooks (nbformat 4, no outputs) from the cell texts of
cells_train.py (01-03) and cells_deploy.py (04-05), with the shared cells of cells_common.py.

    python tutorials/build_notebooks.py          # rewrite tutorials/*.ipynb
    python tutorials/build_notebooks.py --check  # exit 1 if a committed notebook differs

Edit the notebooks here, not in Jupyter, so that they stay output-free and reviewable.
Each notebook has one cell tagged ``parameters`` (papermill) whose first line is ``dataset``:
``"smoke"`` (CIFAR-shaped data made on the spot, a few batches: what CI runs), ``"fashion_mnist"``
(real data, Debian's dataset-fashion-mnist), ``"cifar10"`` (torchvision's download, a GPU).
The notebooks hand files to each other through ``out_dir``:
01 ``ann.pt`` -> 02 ``snn.pt``, ``meta.json`` -> 03 ``snn_finetuned.pt``, ``finetune.json`` ->
04 ``snn.nir``, ``backends/*.json`` -> 05 ``evaluation.json``, ``report.html``.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
sys.path.insert(0, HERE)

from cells_deploy import NB04, NB05  # noqa: E402
from cells_train import NB01, NB02, NB03  # noqa: E402

NOTEBOOKS = {
    "01_train_resnet18_cifar10.ipynb": NB01,
    "02_convert.ipynb": NB02,
    "03_finetune_bptt.ipynb": NB03,
    "04_nir_and_backends.ipynb": NB04,
    "05_analysis.ipynb": NB05,
}


def notebook(cells: list[dict]) -> str:
    nb = {"cells": cells, "metadata": {"kernelspec": KERNEL,
                                       "language_info": {"name": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"cell-{i:02d}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = os.path.join(HERE, name)
        text = notebook(cells)
        if check:
            if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
                stale.append(name)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
    if stale:
        print(f"out of date (run python tutorials/build_notebooks.py): {stale}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
