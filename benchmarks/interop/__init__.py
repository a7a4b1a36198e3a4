"""The interop entry point: NIR with other libraries, and what refusing hostile files costs.

``python -m benchmarks interop QUESTION [ARGS]``; the questions are the modules listed in
``ENTRY``. Its tiny run: the file-limit table: an unused 5 MiB dataset and a chain of 8 nodes,
each loaded in a fresh process. The hostile files are the test suite's own
(``tests/_nirattacks.py``, ``tests/test_graph_injection.py``,
``tests/test_untrusted_files.py``), loaded from their files.
"""

from __future__ import annotations

from ..entry import Entry

__all__ = ["ENTRY", "main"]


ENTRY = Entry(
    name="interop",
    summary="NIR both ways with other libraries, and the cost of refusing hostile NIR and network files",
    questions={
        "nir_consumers": "each library's NIR exports read by snnconv, and snnconv's files by each library",
        "nir_file_limits": "time and memory of refusing oversized NIR files, and of long chains",
        "nir_file_attacks": "hostile NIR and prefix files, each read in a capped process",
        "network_file_attacks": "forged network files, each loaded and run in its own process",
    },
    tiny=("nir_file_limits", "--unused-gib", "0.005", "--chains", "8", "--out", "{out}/nir_file_limits.json"),
    example="python -m benchmarks interop nir_file_limits --chains 1000 4000 10000 --out OUT.json",
)

main = ENTRY.main
