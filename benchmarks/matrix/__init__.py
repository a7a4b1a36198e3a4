"""The matrix entry point: convert() on networks nobody tuned it for, its cells as data.

``python -m benchmarks matrix QUESTION [ARGS]``; the questions are the modules listed in
``ENTRY``. Its tiny run: one narrow small CNN on digits, 4 ANN epochs, the default cell at T = 2
and 4. ``anns`` holds the matrix's networks, data and ANN cache, ``cells`` the conversion cells
(one ``convert()`` call each) and the few-step cells with their floors.
"""

from __future__ import annotations

from ..entry import Entry

__all__ = ["ENTRY", "main"]


ENTRY = Entry(
    name="matrix",
    summary="convert() with its defaults on networks nobody tuned it for, and the evidence behind "
            "the defaults",
    questions={
        "robustness": "the robustness matrix and the few-step cells (--low-t); --table, --compare",
        "defaults_cpu": "conversion settings compared on digits (per-channel, percentile rows)",
        "hard_reset": "conversion-side fixes for reset='zero' on three digits networks",
        "accuracy_vs_T": "snnconv against spikingjelly's converters on a ResNet-14, T = 1..32",
        "finetune": "BPTT fine-tuning of that SNN: accuracy by T, step time, memory",
        "sweep": "several finetune runs side by side, tabulated",
        "edge": "torchvision's networks built for the edge: real ANNs, the default conversion, the diagnosis",
        "early_exit": "early exit, margin against softmax: calibrated on held-out images, read on the test split",
    },
    tiny=("robustness", "--tiny", "--no-finetune", "--no-variants", "--jobs", "1", "--threads", "1",
          "--set", "finetune_epochs=0", "reconstruction_steps=2", "--out", "{out}/robustness"),
    example="python -m benchmarks matrix robustness --low-t --cells T4 --seeds 3 --out OUT/T4",
)

main = ENTRY.main
