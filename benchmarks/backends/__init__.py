"""The backends entry point: the executors' speed and fidelity, and convert()'s own time.

``python -m benchmarks backends QUESTION [ARGS]``; the questions are the modules listed in
``ENTRY``. Its tiny run: the speed table of a ResNet-8 at T=2, batch 4, one timed run per
executor.
"""

from __future__ import annotations

from ..entry import Entry

__all__ = ["ENTRY", "main"]


ENTRY = Entry(
    name="backends",
    summary="the executors against the ANN and each other, and convert()'s time per stage",
    questions={
        "speed": "image-steps per second of the executors against T ANN forwards; --crossover",
        "convert_timing": "convert()'s seconds per stage against the forward passes it needs",
        "loihi2_accuracy": "loihi2-sim's accuracy against the float SNN, both resets",
        "loihi2_agreement": "per-layer detail behind loihi2-sim's agreement with cpu",
        "loihi2_speed": "loihi2-sim's throughput against cpu (and Lava with --lava N)",
    },
    tiny=("speed", "--models", "resnet8", "--T", "2", "--batch", "4", "--repeats", "1", "--threads", "1",
          "--no-compiled", "--no-peers", "--out", "{out}/backends.json"),
    example="python -m benchmarks backends speed --models resnet20 --T 4 8 --batch 128 --clock cpu",
)

main = ENTRY.main
