"""The scale entry point: how conversion grows with the model and the input side.

``python -m benchmarks scale QUESTION [ARGS]``; the questions are the modules listed in
``ENTRY``. Its tiny run: one cell: mobilenet_v2 at 32 px, 8 made images, one reconstruction step
timed.
"""

from __future__ import annotations

from ..entry import Entry

__all__ = ["ENTRY", "main"]


ENTRY = Entry(
    name="scale",
    summary="seconds and peak memory of each stage against the model and the input side",
    questions={
        "sides": "torchvision classifiers at 32-224 px, each cell in a fresh process",
        "resnet50_224": "torchvision's resnet50 at 224 px: the plan, the peak, what ran",
    },
    tiny=("sides", "--models", "mobilenet_v2", "--sizes", "32", "--images", "8", "--batch", "4", "--steps", "1",
          "--threads", "1", "--timeout", "120", "--out", "{out}/scale.json"),
    example="nice -n 10 python -m benchmarks scale sides --threads 1 --fresh",
)

main = ENTRY.main
