"""The coverage entry point: which torchvision classifiers convert, export and run, and which
reach Loihi 2 (``loihi2``: ``--threads --finetune --models --out --finetuned-only``).

``python -m benchmarks coverage QUESTION [ARGS]``; the questions are the modules listed in
``ENTRY``. Its tiny run: the coverage table of one small classifier (squeezenet1_1 at 32 px).
"""

from __future__ import annotations

from ..entry import Entry

__all__ = ["ENTRY", "main"]


ENTRY = Entry(
    name="coverage",
    summary="which torchvision classifiers convert, export to NIR and run bit-identically, and which "
            "reach Loihi 2",
    questions={
        "classifiers": "every torchvision classifier: converts, exports, cpu == torch SNN, refusals",
        "loihi2": "each ReLU-family classifier trained briefly, run by loihi2-sim against cpu",
    },
    tiny=("classifiers", "--models", "squeezenet1_1", "--sizes", "32", "--out", "{out}/coverage.json"),
    example="python -m benchmarks coverage loihi2 --threads 1 --models resnet18 --finetune resnet18",
)

main = ENTRY.main
