"""The early-exit rule: when one image's answer is sure enough to stop running it, defined once.

A spiking network's readout is averaged over its time steps. With early exit each image stops
at the first step ``k`` at which the rule is met on its *accumulated* readout (the sum of the
readouts of steps 1..k), never before ``min_steps`` and never after the run's ``T``; its answer
is its mean readout over those k steps. Every executor (the torch ``SpikingNetwork``, the
backends) decides with :meth:`ExitRule.met` on the accumulated readout, or, when it has run all
T steps, with :meth:`ExitRule.exit_steps` on the per-step readouts.

Two kinds of rule, both on the mean readout ``m = total / k`` of one image (``[classes]``)::

    margin:   (top1(total) - top2(total)) / k >= threshold     the top-1 minus top-2 margin of m
    softmax:  max(softmax(total / k)) >= threshold              the softmax confidence of m

The margin needs no exponential: integer hardware that accumulates its readout checks
``top1 - top2 >= threshold * k``. The scores are computed in float64 from the accumulated
readout, so that every executor that accumulates the same readouts in the same order
(:func:`accumulate`) makes the same decisions.

A leaf: it imports nothing of snnconv but the errors and the shared names, so the backends may
import it (the import contracts in ``pyproject.toml`` say so).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from snnconv.errors import ConfigError, DataError
from snnconv.vocabulary import MAX_T

__all__ = ["EXIT_RULES", "DEFAULT_EXIT_RULE", "DEFAULT_TOLERANCE", "META_KEY", "ExitRule", "exit_score", "accumulate",
           "exit_histogram", "stored_rule"]

#: The kinds of exit rule: the top-1 minus top-2 margin of the mean readout, or its softmax confidence.
EXIT_RULES = ("margin", "softmax")
#: The kind :func:`snnconv.calibrate_exit` calibrates unless told otherwise. Measured on five
#: Fashion-MNIST networks and conversions at four tolerances (benchmarks/README.md, "early_exit"),
#: the two kinds need the same mean steps for the same test accuracy (0.002 steps apart on
#: average, at most 0.1), and calibrated on held-out images the margin's rules ran 4.36 steps on
#: average against the softmax's 4.36, 0.04 points beyond their tolerance on the test split
#: against 0.07; the margin needs no exponential, so a chip computes it on its integer readout.
DEFAULT_EXIT_RULE = "margin"
#: The accuracy (percentage points) that :func:`snnconv.calibrate_exit` lets early exit give up
#: against the fixed T by default.
DEFAULT_TOLERANCE = 0.3
#: Where a network's calibrated rule is kept: ``meta[META_KEY] = {"rule": ExitRule.to_dict(), ...}``
#: (the calibration's record beside it; :func:`snnconv.calibrate_exit` writes it).
META_KEY = "early_exit"


def exit_score(kind: str, total: torch.Tensor, k: int) -> torch.Tensor:
    """Each image's score of ``kind`` after ``k`` steps, from its accumulated readout ``total``.

    .. math::
        \\text{margin} = \\frac{\\text{top}_1(s) - \\text{top}_2(s)}{k}, \\qquad
        \\text{softmax} = \\max_c \\operatorname{softmax}(s / k)_c

    where ``s`` is the accumulated readout of one image (float64).

    Args:
        kind: one of :data:`EXIT_RULES`.
        total: the readouts of steps 1..k summed, ``[B, classes]``.
        k: the steps summed, >= 1.

    Returns:
        ``[B]`` float64 scores (both kinds are >= 0; the softmax's are at most 1).

    Raises:
        ConfigError: an unknown ``kind``.
        DataError: a readout that is not ``[B, classes]`` with at least two classes.
    """
    if kind not in EXIT_RULES:
        raise ConfigError(f"exit rule kind must be one of {EXIT_RULES}, got {kind!r}")
    if total.dim() != 2 or total.shape[1] < 2:
        raise DataError(f"early exit reads one score per class and image, a readout [B, classes] with at "
                        f"least two classes; this network's readout has shape {tuple(total.shape)}")
    s = total.double()
    if kind == "margin":
        top = s.topk(2, dim=1).values
        return (top[:, 0] - top[:, 1]) / k
    return torch.softmax(s / k, dim=1).amax(dim=1)


def accumulate(steps: torch.Tensor) -> torch.Tensor:
    """The accumulated readouts ``[T, B, ...]`` of per-step readouts ``steps`` (``[T, B, ...]``):
    step ``k``'s is the sum of steps 1..k, added one step at a time in order (as a network that
    runs step by step adds them, so that both make the same decisions)."""
    out = torch.empty_like(steps)
    if len(steps):
        out[0] = steps[0]
    for k in range(1, len(steps)):
        torch.add(out[k - 1], steps[k], out=out[k])
    return out


def exit_histogram(exit_steps: torch.Tensor, T: int) -> list[int]:
    """How many images exited at each step 1..T (a list of T counts)."""
    return torch.bincount(exit_steps.reshape(-1).long().cpu(), minlength=T + 1)[1:T + 1].tolist()


def _threshold(value: Any, text: bool = False) -> float:
    """``value`` as a float; ``text``: the string ``"inf"`` (what :meth:`ExitRule.to_dict` writes) too."""
    if text and isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"exit threshold must be a number >= 0 (or inf: never exit before T), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ExitRule:
    """Stop an image at the first step ``k >= min_steps`` where its score reaches ``threshold``.

    The score is :func:`exit_score` of ``kind`` on the image's accumulated readout; an image
    whose score never reaches the threshold runs all T steps of its run. ``threshold = inf``
    never exits before T. :func:`snnconv.calibrate_exit` chooses the threshold from data.

    Args:
        kind: ``"margin"`` (the top-1 minus top-2 margin of the mean readout) or ``"softmax"``
            (the softmax confidence of the mean readout); see :data:`EXIT_RULES`.
        threshold: the score at which an image stops: >= 0; at most 1 for ``"softmax"``; or
            ``math.inf`` (a rule that never exits before T).
        min_steps: no image stops before this step (an integer >= 1).

    Raises:
        ConfigError: a field out of range (naming it and the value given).
    """

    kind: str
    threshold: float
    min_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in EXIT_RULES:
            raise ConfigError(f"exit rule kind must be one of {EXIT_RULES}, got {self.kind!r}")
        threshold = _threshold(self.threshold)
        if math.isnan(threshold) or threshold < 0:
            raise ConfigError(f"exit threshold must be a number >= 0 (or inf: never exit before T), got "
                              f"{self.threshold!r}")
        if self.kind == "softmax" and 1 < threshold < math.inf:
            raise ConfigError(f"a softmax confidence is at most 1, so the exit threshold {self.threshold!r} "
                              "would never be reached: give a threshold in [0, 1], or inf for a rule that "
                              "never exits before T")
        object.__setattr__(self, "threshold", threshold)
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, numbers.Integral) \
                or not 1 <= self.min_steps <= MAX_T:
            raise ConfigError(f"min_steps (the first step at which an image may exit) must be an integer in "
                              f"[1, {MAX_T}], got {self.min_steps!r}")
        object.__setattr__(self, "min_steps", int(self.min_steps))

    def score(self, total: torch.Tensor, k: int) -> torch.Tensor:
        """:func:`exit_score` of this rule's kind: ``[B]`` float64."""
        return exit_score(self.kind, total, k)

    def met(self, total: torch.Tensor, k: int) -> torch.Tensor:
        """Which images stop after step ``k``: a ``[B]`` bool tensor, from their accumulated
        readout ``total`` (``[B, classes]``, the sum of steps 1..k). All False before
        ``min_steps``. The run's last step ends every image whatever this says."""
        if k < self.min_steps or self.threshold == math.inf:
            return torch.zeros(total.shape[0], dtype=torch.bool, device=total.device)
        return self.score(total, k) >= self.threshold

    def exit_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """Each image's exit step (1..T) from a run's per-step readouts ``steps`` (``[T, B,
        classes]``): the first ``k`` at which :meth:`met` holds, else T. For an executor that
        runs all T steps and applies the rule to its readout afterwards."""
        T = steps.shape[0]
        if T < 1:
            raise DataError("exit_steps needs the readouts of at least one step, got none")
        totals = accumulate(steps)
        out = torch.full((steps.shape[1],), T, dtype=torch.long, device=steps.device)
        running = torch.ones(steps.shape[1], dtype=torch.bool, device=steps.device)
        for k in range(self.min_steps, T):
            now = running & self.met(totals[k - 1], k)
            out[now] = k
            running &= ~now
        return out

    def describe(self) -> str:
        """``"margin >= 0.734 from step 2"``: the rule in a few words."""
        threshold = "never before T" if self.threshold == math.inf else f">= {self.threshold:.4g}"
        return f"{self.kind} {threshold}" + (f" from step {self.min_steps}" if self.min_steps > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain data (JSON-ready: an infinite threshold is written ``"inf"``)."""
        return {"kind": self.kind, "threshold": "inf" if self.threshold == math.inf else self.threshold,
                "min_steps": self.min_steps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ExitRule":
        """The rule :meth:`to_dict` wrote.

        Raises:
            ConfigError: not a mapping, a key missing or unknown, or a value out of range.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"an exit rule is stored as a dict with kind, threshold and min_steps; got a "
                              f"{type(data).__name__}")
        keys = {"kind", "threshold", "min_steps"}
        if set(data) - keys or not {"kind", "threshold"} <= set(data):
            raise ConfigError(f"an exit rule is stored as a dict with the keys {sorted(keys)} (min_steps "
                              f"optional); got the keys {sorted(map(str, data))}")
        return cls(kind=data["kind"], threshold=_threshold(data["threshold"], text=True),
                   min_steps=data.get("min_steps", 1))


def stored_rule(meta: Any) -> ExitRule | None:
    """The exit rule stored in a network's metadata ``meta`` (``snn.meta``, or the metadata a
    NIR file carries) under :data:`META_KEY`, or None where none is stored.

    Raises:
        ConfigError: an entry that is not a calibration record with a valid rule (saying what to do).
    """
    if not isinstance(meta, Mapping) or meta.get(META_KEY) is None:
        return None
    entry = meta[META_KEY]
    try:
        if not isinstance(entry, Mapping) or "rule" not in entry:
            raise ConfigError(f"expected a dict with the key 'rule', got {type(entry).__name__}"
                              + (f" with the keys {sorted(map(str, entry))}" if isinstance(entry, Mapping) else ""))
        return ExitRule.from_dict(entry["rule"])
    except ConfigError as exc:
        raise ConfigError(f"the network's stored early-exit rule (meta[{META_KEY!r}]) is malformed: {exc}. "
                          "Calibrate it again (snnconv.calibrate_exit), or remove the entry") from None
