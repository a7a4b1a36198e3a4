"""``gpu``: snnconv NIR graphs on CUDA, float32 or bfloat16, with a fused multi-step neuron.

The graph runs like on ``cpu`` (static layers once, time folded into the batch, the same op
order; see ``engine``) on a CUDA device. The neuron update of a whole layer over all T steps
is one kernel: ``torch.compile`` (Triton) fuses the unrolled loop so that the input is read
once, the spikes are written once and the membrane stays in registers, together with the batch
sums the statistics need. Without Triton it falls back to the in-place loop (3 kernels a step).

- ``dtype="float32"`` with ``deterministic=True`` (default): cuDNN picks deterministic
  algorithms and TF32 is off during the run, so results repeat exactly; spikes equal the cpu
  backend's except where a membrane lands within rounding of the threshold (the two libraries
  round convolutions differently). ``count_ties=True`` reports how many updates had
  ``|h - threshold| <= tie_tolerance * threshold`` (``extra["threshold_ties"]``).
- ``dtype="bfloat16"``: layers in bfloat16 (tensor cores), membranes in float32; spikes are
  still binary, outputs are bfloat16.

Raises BackendError when no CUDA device exists. ``device="cpu"`` runs this same code on the
CPU (a test of the code path on machines without a GPU; use the cpu backend for real work).
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

__all__ = ["GPUBackend", "GPUProgram", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_OPTIONS = {
    "dtype": "float32",        # "float32" | "bfloat16"
    "device": "cuda",          # "cuda", "cuda:N" (or "cpu" to exercise the code path)
    "deterministic": True,     # deterministic cuDNN, no TF32 (float32)
    "neuron": "auto",          # "compiled" (torch.compile/Triton), "loop", "auto" (compiled if Triton)
    "chunk_size": 0,           # time-folded samples per chunk (0: the whole batch at once)
    "count_ties": False,       # count membranes within tie_tolerance of the threshold (uses the loop)
    "tie_tolerance": 1e-6,     # relative to the threshold
    "dt": 1.0,                 # the time step the graph is read at (r * dt = 1; snnconv.nir.reader.parse)
    "compare": None,           # IF nodes stating no comparison: None (NIR's ">") or ">="
}
_NEURON = ("auto", "compiled", "loop")


def _cuda_reason() -> str:
    if not torch.cuda.is_available():
        built = torch.version.cuda
        return ("no CUDA device (torch.cuda.is_available() is False; torch "
                f"{torch.__version__} {'built with CUDA ' + built if built else 'is a CPU-only build'})")
    return ""


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _numerics(device: torch.device, deterministic: bool):
    """cuDNN/TF32 settings for one run, restored afterwards."""
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    if deterministic:
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = True, False, False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = False, True, True
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with torch.cuda.device(device):
            yield
    finally:
        (cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved


class GPUProgram(BoundProgram):
    """A graph compiled for the gpu backend; results stay on the device (``outputs``)."""

    name = "gpu"

    def __init__(self, bound: BoundGraph, *, chunk_size: int, deterministic: bool, neuron: str):
        self.bound = bound
        self.chunk_size = chunk_size
        self.deterministic = deterministic
        self.neuron = neuron

    def run(self, x: torch.Tensor, T: int | None = None, *, exit_rule: Any = None) -> RunResult:
        """Run ``T`` steps on ``x`` (``[B, ...]`` or ``[T, B, ...]``, any device).

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
        dev = self.bound.device
        with torch.no_grad(), _numerics(dev, self.deterministic):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            if rule is None:
                out, extra = self._run_chunks(x, T, seq, per, stats), {}
            else:
                out, record = self._run_exit(x, T, rule, stats)  # type: ignore[arg-type]
                extra = {"early_exit": record}
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - start
            result = self._result(out, stats, B, T, per, seconds, device=str(dev),
                                  deterministic=self.deterministic, neuron=self.neuron, **extra)
        if self.bound.tie_tolerance is not None:  # counted by the run, summed by the result's stats
            result.extra.update(threshold_ties=stats.ties, tie_tolerance=self.bound.tie_tolerance)
        return result


class GPUBackend(Backend):
    """CUDA executor (options: dtype, device, deterministic, neuron, chunk_size, count_ties,
    tie_tolerance, dt; see the module docstring and the cpu backend's)."""

    name = "gpu"

    def availability(self) -> tuple[bool, str]:
        reason = _cuda_reason()
        return (not reason), reason

    def compile(self, graph: Any, **options: Any) -> GPUProgram:
        """Parse ``graph`` strictly and bind it to a CUDA device.

        Raises:
            BackendError: no CUDA device, an unknown option or value, a node the executor
                cannot run, or a graph the strict reader refuses.
        """
        opts = check_options(self.name, options, _OPTIONS)
        try:
            device = torch.device(opts["device"])
        except (RuntimeError, TypeError) as exc:
            raise BackendError(f"backend 'gpu': bad device {opts['device']!r} ({exc})") from exc
        if device.type == "cuda":
            reason = _cuda_reason()
            if reason:
                raise BackendError(f"backend 'gpu' is not usable here: {reason}; use the cpu backend")
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise BackendError(f"backend 'gpu': device {device} does not exist "
                                   f"({torch.cuda.device_count()} CUDA device(s))")
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise BackendError(f"backend 'gpu': device {device} is neither CUDA nor cpu")
        dtype = dtype_option(opts["dtype"], self.name, DTYPES)
        if opts["neuron"] not in _NEURON:
            raise BackendError(f"backend 'gpu': neuron must be one of {_NEURON}, got {opts['neuron']!r}")
        neuron = opts["neuron"]
        if neuron == "auto":
            neuron = "compiled" if (device.type == "cuda" and _triton()) else "loop"
        chunk = opts["chunk_size"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise BackendError(f"backend 'gpu': chunk_size must be an integer >= 0, got {chunk!r}")
        tol = None
        if opts["count_ties"]:
            tol = float(opts["tie_tolerance"])
            if not tol >= 0:
                raise BackendError(f"backend 'gpu': tie_tolerance must be >= 0, got {tol}")
            neuron = "loop"
        parsed = parse_graph(graph, self.name, opts["dt"], opts["compare"])
        bound = BoundGraph(parsed, device=device, dtype=dtype, backend=self.name,
                    neuron_loop=compiled_loop if neuron == "compiled" else None,
                    neuron_dtype=torch.float32, tie_tolerance=tol)
        return GPUProgram(bound, chunk_size=chunk, deterministic=bool(opts["deterministic"]),
                          neuron=neuron)
