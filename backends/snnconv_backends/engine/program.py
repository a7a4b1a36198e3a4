"""What the cpu and gpu programs share: a compiled :class:`BoundGraph` run in chunks, its input checks
and the dtype option."""

from __future__ import annotations

from typing import Any

import torch

from snnconv.errors import BackendError
from snnconv.exit_rule import ExitRule, exit_histogram
from snnconv_backends.engine.bound import BoundGraph, Carry, check_T
from snnconv_backends.engine.stats import Stats
from snnconv_backends.registry import Program, RunResult

__all__ = ["BoundProgram", "StepStats", "dtype_option"]


class StepStats(Stats):
    """:class:`Stats` of a run continued one step at a time: the spikes of each call (``[1, b,
    ...]``) are counted at step :attr:`step` of the run."""

    def __init__(self, bound: BoundGraph, T: int):
        super().__init__(bound, T)
        self.step = 0

    def add_neuron(self, name: str, s: torch.Tensor, per_pos: torch.Tensor | None = None) -> None:
        if per_pos is None:
            per_pos = s.reshape(s.shape[0], s.shape[1], -1).sum(1, dtype=torch.float32)
        row = per_pos.to(torch.float64)[0]
        if name not in self.acc:
            self.acc[name] = torch.zeros((self.T, row.numel()), dtype=torch.float64, device=row.device)
        self.acc[name][self.step] += row


def dtype_option(value: Any, backend: str, allowed: dict[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype):
        value = str(value).replace("torch.", "")
    if value not in allowed:
        raise BackendError(f"backend {backend!r}: dtype {value!r} is not supported; choose one of "
                           f"{', '.join(allowed)}")
    return allowed[value]


class BoundProgram(Program):
    """What the cpu and gpu programs share: a compiled :class:`BoundGraph`, its input shape and T."""

    name = "cpu"
    bound: BoundGraph
    chunk_size: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The batch-free input shape the graph takes."""
        return self.bound.input_shape

    @property
    def default_T(self) -> int | None:
        """The T recorded in the graph's metadata (the one it was exported at), if any."""
        return self.bound.parsed.T

    def _checked(self, x: torch.Tensor, T: int | None) -> tuple[torch.Tensor, bool, int]:
        """``(x, is_sequence, T)`` after the shape, dtype and T checks (T defaults to the graph's)."""
        if T is None:
            T = self.default_T
            if T is None:
                raise BackendError(f"backend {self.name!r}: give T (the graph records none)")
        T = check_T(T)
        x, seq = self.bound.check_input(x, T)
        return x, seq, T

    def _chunking(self, x: torch.Tensor, seq: bool, T: int) -> tuple[int, int]:
        """``(B, per)``: the batch size and how many inputs one chunk of ``chunk_size`` holds."""
        B = x.shape[1] if seq else x.shape[0]
        per = max(1, self.chunk_size // T) if self.chunk_size else B
        return B, per

    def _run_chunks(self, x: torch.Tensor, T: int, seq: bool, per: int, stats: Stats) -> torch.Tensor:
        """The bound graph run on ``per`` inputs at a time, the readouts joined along the batch."""
        parts = x.split(per, dim=1 if seq else 0)
        outs = [self.bound.run_chunk(p, T, seq, stats) for p in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _exit_rule(self, rule: Any) -> ExitRule | None:
        """``rule`` checked: None or an :class:`~snnconv.exit_rule.ExitRule`."""
        if rule is not None and not isinstance(rule, ExitRule):
            raise BackendError(f"backend {self.name!r}: exit_rule must be an snnconv.exit_rule.ExitRule or None, "
                               f"got a {type(rule).__name__}")
        return rule

    def _run_exit(self, x: torch.Tensor, T: int, rule: ExitRule, stats: "StepStats") -> tuple[torch.Tensor, dict]:
        """Each image of the static batch ``x`` run step by step until ``rule`` is met on its
        accumulated readout (:meth:`ExitRule.met <snnconv.exit_rule.ExitRule.met>`), then
        dropped from the batch, so that later steps run only on the others. Returns the per-step
        readout ``[T, B, ...]`` (after an image's exit step, its answer: the mean of the steps
        it ran) and the record ``{"rule", "steps" [B], "output" [B, ...], "mean_steps",
        "histogram"}``."""
        if x.dim() != len(self.bound.input_shape) + 1:
            raise BackendError(f"backend {self.name!r}: early exit takes a static batch [B, ...], not a "
                               "sequence")
        per = self.chunk_size or x.shape[0]  # images a step holds at most (one step: no time folding)
        outs: list[torch.Tensor] = []
        answers: list[torch.Tensor] = []
        exits: list[torch.Tensor] = []
        for part in x.split(per):
            b = part.shape[0]
            carry, active = Carry(), torch.arange(b, device=part.device)
            steps: torch.Tensor | None = None
            total: torch.Tensor | None = None
            answer: torch.Tensor | None = None
            exit_at = torch.full((b,), T, dtype=torch.long)
            xa = part
            for k in range(1, T + 1):
                stats.step = k - 1
                y = self.bound.run_chunk(xa, 1, False, stats, carry)[0]
                if steps is None:
                    steps = y.new_empty((T, b, *y.shape[1:]))
                    answer = y.new_empty((b, *y.shape[1:]))
                steps[k - 1, active] = y
                total = y.clone() if total is None else total.add_(y)  # steps 1..k summed in order
                done = (torch.ones(len(active), dtype=torch.bool, device=y.device) if k == T
                        else rule.met(total.reshape(len(active), -1), k).to(y.device))
                if bool(done.any()):
                    rows = active[done]
                    mean = total[done] / k
                    answer[rows] = mean  # type: ignore[index]
                    steps[k:, rows] = mean
                    exit_at[rows.cpu()] = k
                    keep = ~done
                    active, total, xa = active[keep], total[keep], xa[keep]
                    carry.keep(keep)
                if not len(active):
                    break
            assert steps is not None and answer is not None  # T >= 1: at least one step ran
            outs.append(steps)
            answers.append(answer)
            exits.append(exit_at)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        exit_steps = torch.cat(exits)
        return out, {"rule": rule.to_dict(), "steps": exit_steps, "output": torch.cat(answers),
                     "mean_steps": float(exit_steps.double().mean()), "histogram": exit_histogram(exit_steps, T),
                     "dropped": True}

    def _result(self, out: torch.Tensor, stats: Stats, B: int, T: int, per: int, seconds: float,
                **extra: Any) -> RunResult:
        """The run's :class:`RunResult`: outputs, spikes and synaptic operations from ``stats``
        (finished here), the ANN's MACs for ``B`` inputs, and what the run was (``extra`` added)."""
        spikes, synops = stats.finish(self.bound)
        macs = {k: v * B for k, v in self.bound.macs_per_image.items()}
        record = {"T": T, "batch": B, "dtype": str(self.bound.dtype).replace("torch.", ""), "chunk_inputs": per,
                  "static_ops": list(self.bound.static_ops), "seconds": seconds, "reset": self.bound.reset, **extra}
        return RunResult(outputs=out, spikes=spikes, synops=synops, macs=macs, extra=record)
