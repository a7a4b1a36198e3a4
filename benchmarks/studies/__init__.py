"""Settled studies: each answered one question, and a default or a design follows from it.

Each module runs as ``python -m benchmarks.studies.NAME`` and writes under
``benchmarks/studies/results/``; ``benchmarks/studies/README.md`` says what each decided.
"""
