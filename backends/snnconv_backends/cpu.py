"""``cpu``: the exact reference executor of snnconv NIR graphs.

Outputs and spikes are bit-identical to the torch ``SpikingNetwork`` the graph was exported
from (float32; float64 with ``dtype="float64"``, against ``snn.double()``), because it performs
the same floating-point operations on the same batch compositions (see ``engine``). It is
faster than the torch network because the neuron update runs in place with no per-step
allocation, copy or stack, static layers run once, and intermediate values are freed (or
reused) as soon as their last reader has run.

    >>> program = snnconv.backends.get("cpu").compile(graph)
    >>> result = program.run(x, T=8)           # x: [B, C, H, W]
    >>> result.outputs.mean(0).argmax(1)       # the prediction
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from snnconv.errors import BackendError
from snnconv_backends.engine import (
    BoundGraph,
    BoundProgram,
    Stats,
    StepStats,
    check_options,
    compiled_loop,
    dtype_option,
)
from snnconv_backends.registry import Backend, RunResult, parse_graph

__all__ = ["CPUBackend", "CPUProgram", "DTYPES", "compile_parsed", "parse_graph"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}

_OPTIONS = {
    "dtype": "float32",     # "float32" | "float64"
    "chunk_size": 256,      # time-folded samples per chunk, as SpikingNetwork.chunk_size (0: none)
    "threads": None,        # torch threads during run (None: leave torch's setting)
    "neuron": "loop",       # "loop": in-place torch ops; "compiled": one fused kernel per neuron
                            # layer through torch.compile (needs a C++ compiler; compiles once)
    "dt": 1.0,              # the time step the graph is read at (r * dt = 1; snnconv.nir.reader.parse)
    "compare": None,        # IF nodes stating no comparison: None (NIR's ">") or ">="
}
_NEURON = ("loop", "compiled")


class CPUProgram(BoundProgram):
    """A graph compiled for the cpu backend."""

    def __init__(self, bound: BoundGraph, *, chunk_size: int, threads: int | None, name: str = "cpu"):
        self.bound = bound
        self.chunk_size = chunk_size
        self.threads = threads
        self.name = name

    def run(self, x: torch.Tensor, T: int | None = None, *, exit_rule: Any = None) -> RunResult:
        """Run ``T`` steps (default: the graph's T) on ``x`` (``[B, ...]`` or ``[T, B, ...]``).

        ``exit_rule``: an :class:`~snnconv.exit_rule.ExitRule`: each image stops at the step its
        readout meets the rule and leaves the batch (``extra["early_exit"]``; see
        :meth:`~snnconv_backends.engine.BoundProgram._run_exit`).

        Raises:
            BackendError: wrong input shape or dtype, or ``T < 1``.
        """
        x, seq, T = self._checked(x, T)
        B, per = self._chunking(x, seq, T)
        rule = self._exit_rule(exit_rule)
        stats = Stats(self.bound, T) if rule is None else StepStats(self.bound, T)
        start = time.perf_counter()
        with torch.no_grad(), _threads(self.threads):  # plain tensors out (not inference tensors)
            if rule is None:
                out, extra = self._run_chunks(x, T, seq, per, stats), {}
            else:
                out, record = self._run_exit(x, T, rule, stats)  # type: ignore[arg-type]
                extra = {"early_exit": record}
        return self._result(out, stats, B, T, per, time.perf_counter() - start, **extra)


@contextlib.contextmanager
def _threads(n: int | None):
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def compile_parsed(parsed: Any, *, dtype: torch.dtype = torch.float32, chunk_size: int = 256,
                   threads: int | None = None, neuron: str = "loop") -> CPUProgram:
    """A :class:`CPUProgram` for an already parsed graph (``snnconv.nir.reader.parse``)."""
    bound = BoundGraph(parsed, device=torch.device("cpu"), dtype=dtype, backend="cpu",
                neuron_loop=compiled_loop if neuron == "compiled" else None)
    return CPUProgram(bound, chunk_size=chunk_size, threads=threads)


class CPUBackend(Backend):
    """The exact CPU executor.

    Options: ``dtype`` ("float32" or "float64"), ``chunk_size`` (time-folded samples per
    chunk; keep SpikingNetwork's 256 for bit identity), ``threads``, ``neuron`` ("loop", or
    "compiled": a fused torch.compile kernel per neuron layer, several times faster once
    compiled, same bits), ``dt`` (the time step the graph is read at, default 1: NIR is
    continuous time and an integrator with resistance ``r`` needs ``r * dt = 1``), ``compare``
    (the comparison of IF nodes that state none: None, NIR's ``">"``, or ``">="``).
    """

    name = "cpu"

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def compile(self, graph: Any, **options: Any) -> CPUProgram:
        """Parse ``graph`` strictly and bind it to the CPU.

        Raises:
            BackendError: an unknown option or value, a node the executor cannot run, or a
                graph the strict reader refuses (its NIRError is the cause).
        """
        opts = check_options(self.name, options, _OPTIONS)
        dtype = dtype_option(opts["dtype"], self.name, DTYPES)
        chunk = opts["chunk_size"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise BackendError(f"backend 'cpu': chunk_size must be an integer >= 0 (0: no "
                               f"chunking), got {chunk!r}")
        threads = opts["threads"]
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise BackendError(f"backend 'cpu': threads must be None or an integer >= 1, got {threads!r}")
        if opts["neuron"] not in _NEURON:
            raise BackendError(f"backend 'cpu': neuron must be one of {_NEURON}, got {opts['neuron']!r}")
        parsed = parse_graph(graph, self.name, opts["dt"], opts["compare"])
        return compile_parsed(parsed, dtype=dtype, chunk_size=chunk,
                              threads=threads, neuron=opts["neuron"])
