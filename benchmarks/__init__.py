"""snnconv's benchmarks: a few entry points, each a question of the benchmarks README.

``python -m benchmarks ENTRY [QUESTION] [ARGS]`` with ENTRY one of ``ENTRIES``; every entry has a
``--tiny`` mode. The settled studies are modules under ``benchmarks.studies``.
"""

__all__ = ["ENTRIES"]

#: entry point -> what it answers
ENTRIES = {
    "matrix": "convert() on networks nobody tuned it for: the robustness and few-step cells, the "
              "defaults' evidence, hard reset, accuracy against T, fine-tuning and its sweeps",
    "backends": "the executors: speed against the ANN, the Loihi 2 simulator's accuracy, agreement "
                "and speed, convert()'s time per stage",
    "interop": "NIR with other libraries, and what refusing hostile NIR and network files costs",
    "coverage": "which torchvision classifiers convert, export and run, and which reach Loihi 2",
    "scale": "how conversion grows with the model and the input side",
    "gpu_check": "the gpu backend against cpu, and its throughput",
}
