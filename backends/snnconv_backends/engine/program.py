"""What the cpu and gpu programs share: a compiled :class:`Plan` run in chunks, its input checks
and the dtype option."""

from __future__ import annotations

from typing import Any

import torch

from snnconv.errors import BackendError
from snnconv_backends.engine.plan import Plan, check_T
from snnconv_backends.engine.stats import Stats
from snnconv_backends.registry import Program, RunResult

__all__ = ["PlanProgram", "dtype_option"]


def dtype_option(value: Any, backend: str, allowed: dict[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype):
        value = str(value).replace("torch.", "")
    if value not in allowed:
        raise BackendError(f"backend {backend!r}: dtype {value!r} is not supported; choose one of "
                           f"{', '.join(allowed)}")
    return allowed[value]


class PlanProgram(Program):
    """What the cpu and gpu programs share: a compiled :class:`Plan`, its input shape and T."""

    name = "cpu"
    plan: Plan
    chunk_size: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The batch-free input shape the graph takes."""
        return self.plan.input_shape

    @property
    def default_T(self) -> int | None:
        """The T recorded in the graph's metadata (the one it was exported at), if any."""
        return self.plan.parsed.T

    def _checked(self, x: torch.Tensor, T: int | None) -> tuple[torch.Tensor, bool, int]:
        """``(x, is_sequence, T)`` after the shape, dtype and T checks (T defaults to the graph's)."""
        if T is None:
            T = self.default_T
            if T is None:
                raise BackendError(f"backend {self.name!r}: give T (the graph records none)")
        T = check_T(T)
        x, seq = self.plan.check_input(x, T)
        return x, seq, T

    def _chunking(self, x: torch.Tensor, seq: bool, T: int) -> tuple[int, int]:
        """``(B, per)``: the batch size and how many inputs one chunk of ``chunk_size`` holds."""
        B = x.shape[1] if seq else x.shape[0]
        per = max(1, self.chunk_size // T) if self.chunk_size else B
        return B, per

    def _run_chunks(self, x: torch.Tensor, T: int, seq: bool, per: int, stats: Stats) -> torch.Tensor:
        """The plan run on ``per`` inputs at a time, the readouts joined along the batch."""
        parts = x.split(per, dim=1 if seq else 0)
        outs = [self.plan.run_chunk(p, T, seq, stats) for p in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _result(self, out: torch.Tensor, stats: Stats, B: int, T: int, per: int, seconds: float,
                **extra: Any) -> RunResult:
        """The run's :class:`RunResult`: outputs, spikes and synaptic operations from ``stats``
        (finished here), the ANN's MACs for ``B`` inputs, and what the run was (``extra`` added)."""
        spikes, synops = stats.finish(self.plan)
        macs = {k: v * B for k, v in self.plan.macs_per_image.items()}
        record = {"T": T, "batch": B, "dtype": str(self.plan.dtype).replace("torch.", ""), "chunk_inputs": per,
                  "static_ops": list(self.plan.static_ops), "seconds": seconds, "reset": self.plan.reset, **extra}
        return RunResult(outputs=out, spikes=spikes, synops=synops, macs=macs, extra=record)
