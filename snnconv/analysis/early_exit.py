"""Early exit: each image stops at the step where its answer is sure (the rule:
:mod:`snnconv.exit_rule`), calibrated on held-out data and evaluated.

    record = snnconv.calibrate_exit(snn, held_out, tolerance=0.3)   # stored in snn.meta
    result = snnconv.evaluate_exit(snn, test)                       # uses the stored rule
    print(result.accuracy, result.mean_steps, result.histogram)

Calibration runs the network once at the fixed T (time folded into the batch, as
``snn.run``) and derives, from each image's accumulated readout after every step, the accuracy
and the mean steps of *every* threshold at once: an image that exits at step k has the output
of the fixed-T run truncated at k (:meth:`SpikingNetwork.run_with_exit
<snnconv.snn.network.SpikingNetwork.run_with_exit>`), so no threshold needs a run of its own.
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from snnconv.analysis.metrics import _evaluating
from snnconv.data import SameShape, bounded, check_labels, split_batch
from snnconv.errors import ConfigError, DataError
from snnconv.exit_rule import (
    DEFAULT_EXIT_RULE,
    DEFAULT_TOLERANCE,
    EXIT_RULES,
    META_KEY,
    ExitRule,
    accumulate,
    exit_histogram,
    exit_score,
    stored_rule,
)
from snnconv.progress import progress_bar
from snnconv.snn.network import SpikingNetwork, check_T

__all__ = ["ExitEvaluation", "ExitCurve", "ExitCalibration", "evaluate_exit", "exit_curves", "calibrate_exit",
           "DEFAULT_TOLERANCE"]

@dataclass(frozen=True)
class ExitEvaluation:
    """What :func:`evaluate_exit` measured: ``accuracy`` (percent) with ``rule`` (None: fixed
    T), the ``mean_steps`` per image, the ``histogram`` of exit steps (images that stopped at
    step 1, ..., T) over ``images`` images, each run at most ``T`` steps."""

    rule: ExitRule | None
    T: int
    images: int
    accuracy: float
    mean_steps: float
    histogram: list[int]

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data."""
        return {"rule": None if self.rule is None else self.rule.to_dict(), "T": self.T, "images": self.images,
                "accuracy": self.accuracy, "mean_steps": self.mean_steps, "histogram": list(self.histogram)}


@dataclass(frozen=True)
class ExitCurve:
    """Accuracy against mean steps for every threshold of one rule ``kind`` on one data set.

    One point per distinct behaviour, loosest first: ``thresholds[i]`` (0.0 for the first,
    which stops every image at ``min_steps``; a midpoint between two observed scores in
    between; ``inf`` for the last, which runs every image T steps) gives ``accuracy[i]``
    (percent) at ``mean_steps[i]``. ``accuracy_fixed`` is the accuracy at the fixed ``T``;
    ``edges`` the scores at which the behaviour changes (point ``i`` holds for thresholds in
    ``(edges[i - 1], edges[i]]``).
    """

    kind: str
    min_steps: int
    T: int
    images: int
    accuracy_fixed: float
    thresholds: list[float]
    accuracy: list[float]
    mean_steps: list[float]
    edges: list[float] = field(default_factory=list, repr=False)

    def point(self, threshold: float) -> int:
        """The index of the point that ``threshold`` gives on these images (a threshold chosen
        on other data, say)."""
        return bisect.bisect_left(self.edges, float(threshold))

    def loosest(self, tolerance: float) -> int:
        """The index of the loosest point whose accuracy is at least ``accuracy_fixed -
        tolerance``, as is every stricter point's (the last point, every image at T, always is)."""
        need = self.accuracy_fixed - float(tolerance) - 1e-9
        chosen = len(self.accuracy) - 1
        while chosen > 0 and self.accuracy[chosen - 1] >= need:
            chosen -= 1
        return chosen

    def to_dict(self) -> dict[str, Any]:
        """The curve as plain data (an infinite threshold written ``"inf"``)."""
        return {"kind": self.kind, "min_steps": self.min_steps, "T": self.T, "images": self.images,
                "accuracy_fixed": self.accuracy_fixed,
                "thresholds": ["inf" if t == math.inf else t for t in self.thresholds],
                "accuracy": list(self.accuracy), "mean_steps": list(self.mean_steps)}


@dataclass(frozen=True)
class ExitCalibration:
    """What :func:`calibrate_exit` chose and why.

    ``rule`` is the loosest setting whose accuracy on the ``images`` calibration images stays
    within ``tolerance`` points of the fixed-``T`` accuracy (``accuracy_fixed``), as does every
    stricter one; with it those images reach ``accuracy`` in ``mean_steps`` steps on average,
    ``histogram`` counting the images that stopped at step 1, ..., T. ``targets`` says what
    was right: ``"labels"``, or ``"fixed-T answers"`` (the network's own answers at T).
    ``curve``: every setting of the rule's kind (:class:`ExitCurve`; not stored).
    """

    rule: ExitRule
    T: int
    tolerance: float
    targets: str
    images: int
    accuracy_fixed: float
    accuracy: float
    mean_steps: float
    histogram: list[int]
    curve: ExitCurve | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data, as ``snn.meta["early_exit"]`` keeps it (without the curve)."""
        return {"rule": self.rule.to_dict(), "T": self.T, "tolerance": self.tolerance, "targets": self.targets,
                "images": self.images, "accuracy_fixed": self.accuracy_fixed, "accuracy": self.accuracy,
                "mean_steps": self.mean_steps, "histogram": list(self.histogram)}


def _batches(data: Iterable, where: str, labels: bool):
    """``(x, y)`` of each batch (``y`` None where ``labels`` is False); a batch without labels is
    refused where they are needed."""
    same = SameShape(where)
    for i, batch in enumerate(bounded(data, where=where)):
        x, y = split_batch(batch, where=where)
        same(x, i)
        if labels and y is None:
            raise DataError(f"{where} yielded inputs without labels; give (x, y) batches, or labels=False "
                            "to measure against the network's own answers at the fixed T")
        yield x, (y if labels else None)


def _T(snn: SpikingNetwork, T: int | None) -> int:
    T = snn.T if T is None else T
    check_T(T)
    return int(T)


def evaluate_exit(snn: SpikingNetwork, data: Iterable, rule: ExitRule | None | str = "stored", *,
                  T: int | None = None, device: torch.device | str = "cpu", progress: bool = False
                  ) -> ExitEvaluation:
    """Accuracy, mean steps and exit histogram of ``snn`` with early exit on labelled ``data``.

    Every batch runs step by step and drops the images that have exited
    (:meth:`SpikingNetwork.run_with_exit`); an image's answer is the arg-max of its mean
    readout over the steps it ran. Never draws from the global RNG.

    Args:
        snn: a converted network, already on ``device``.
        data: an iterable of ``(x, y)`` batches (a DataLoader).
        rule: an :class:`~snnconv.exit_rule.ExitRule`; ``"stored"`` (default): the rule
            :func:`calibrate_exit` stored with the network, or none if it has none; ``None``: no
            early exit (the predictions of :func:`snnconv.analysis.metrics.evaluate` at T, bit
            for bit).
        T: the most steps an image runs (default ``snn.T``).
        device: where the batches go.
        progress: a progress bar over the batches.

    Returns:
        :class:`ExitEvaluation`.

    Raises:
        DataError: ``data`` is empty or has batches without labels.
        ConfigError: ``rule`` is not a rule, or the stored one is malformed.
    """
    T = _T(snn, T)
    if isinstance(rule, str):
        if rule != "stored":
            raise ConfigError(f"rule must be an ExitRule, None (no early exit) or 'stored', got {rule!r}")
        rule = stored_rule(snn.meta)
    right, steps = 0, []
    with _evaluating(snn):
        for x, y in progress_bar(_batches(data, "the evaluation data", True), desc="evaluate with exit",
                                 disable=not progress, leave=False):
            assert y is not None
            run = snn.run_with_exit(x.to(device), rule, T=T)
            check_labels(y, run.output.shape[1], where="the evaluation data")
            right += int((run.output.argmax(1).cpu() == y.cpu()).sum())
            steps.append(run.steps.cpu())
    if not steps:
        raise DataError("the evaluation data is empty: it yielded no batch")
    taken = torch.cat(steps)
    return ExitEvaluation(rule=rule, T=T, images=len(taken), accuracy=100.0 * right / len(taken),
                          mean_steps=float(taken.double().mean()), histogram=exit_histogram(taken, T))


@dataclass
class _Observed:
    """Per image and step (``[N, T]``): each kind's score and whether the answer was right."""

    scores: dict[str, torch.Tensor]
    right: torch.Tensor
    targets: str


def _observe(snn: SpikingNetwork, data: Iterable, T: int, labels: bool, device: torch.device | str,
             progress: bool) -> _Observed:
    """One fixed-T run over ``data``: every image's score of each kind after each step, and
    whether its answer then (the arg-max of its accumulated readout over k, as an early-exit
    run gives it) was its label, or its own answer at T."""
    scores: dict[str, list[torch.Tensor]] = {kind: [] for kind in EXIT_RULES}
    right = []
    with _evaluating(snn):
        for x, y in progress_bar(_batches(data, "the calibration data", labels), desc="exit calibration",
                                 disable=not progress, leave=False):
            totals = accumulate(snn.run(x.to(device), T=T))
            for kind in EXIT_RULES:  # a readout that is not [B, classes] is refused here, by shape
                scores[kind].append(torch.stack([exit_score(kind, totals[k], k + 1) for k in range(T)], 1).cpu())
            answers = torch.stack([(totals[k] / (k + 1)).argmax(1) for k in range(T)], dim=1).cpu()
            if y is not None:
                check_labels(y, totals.shape[-1], where="the calibration data")
            target = (y.cpu() if y is not None else answers[:, -1]).reshape(-1, 1)
            right.append(answers == target)
    if not right:
        raise DataError("the calibration data is empty: it yielded no batch")
    return _Observed({k: torch.cat(v) for k, v in scores.items()}, torch.cat(right),
                     "labels" if labels else "fixed-T answers")


def _sweep(score: torch.Tensor, right: torch.Tensor, min_steps: int
           ) -> tuple[list[float], list[float], list[int], list[int]]:
    """Every distinct behaviour of ``score >= threshold`` (``score``, ``right``: ``[N, T]``),
    loosest first: ``(thresholds, edges, right answers, steps run)``, the last two summed over
    the images, ``edges`` the scores where the behaviour changes.

    An image stops at the first step ``k`` in ``[min_steps, T)`` whose score reaches the
    threshold, else at T: with ``P[k]`` its running maximum of the scores from ``min_steps``,
    raising the threshold past a value of ``P`` moves it from the first step of that value to
    the first step of the next larger one. Those moves, sorted by value and summed, give every
    threshold's totals in ``O(N T log(N T))``.
    """
    N, T = score.shape
    m = min(min_steps, T)
    base_right, base_steps = int(right[:, m - 1].sum()), N * m
    if m >= T:
        return [0.0], [], [base_right], [base_steps]
    P = torch.cummax(score[:, m - 1:T - 1], dim=1).values  # steps m .. T-1
    P = torch.cat([P, torch.full((N, 1), math.inf, dtype=P.dtype)], dim=1)  # step T ends every image
    L = P.shape[1]
    start = torch.ones_like(P, dtype=torch.bool)
    start[:, 1:] = P[:, 1:] > P[:, :-1]
    nxt = torch.full((N, L), L - 1, dtype=torch.long)  # the next start to the right of each column
    for c in range(L - 2, -1, -1):
        nxt[:, c] = torch.where(start[:, c + 1], torch.tensor(c + 1), nxt[:, c + 1])
    at = start[:, :L - 1]  # a move per start of a finite value
    rows, col = at.nonzero(as_tuple=True)
    col_to = nxt[rows, col]
    values = P[rows, col]
    d_steps = col_to - col
    r = right[:, m - 1:].long()
    d_right = r[rows, col_to] - r[rows, col]
    order = torch.argsort(values, stable=True)
    values, d_steps, d_right = values[order], d_steps[order], d_right[order]
    last = torch.ones(len(values), dtype=torch.bool)  # the last move of each distinct value
    last[:-1] = values[1:] > values[:-1]
    cum_steps = base_steps + torch.cumsum(d_steps, 0)[last]
    cum_right = base_right + torch.cumsum(d_right, 0)[last]
    u = values[last].tolist()
    thresholds = [0.0] + [(a + b) / 2 for a, b in zip(u[:-1], u[1:])] + [math.inf]
    return thresholds, u, [base_right] + cum_right.tolist(), [base_steps] + cum_steps.tolist()


def _curve(obs: _Observed, kind: str, min_steps: int) -> ExitCurve:
    score, right = obs.scores[kind], obs.right
    N, T = right.shape
    thresholds, edges, rights, steps = _sweep(score, right, min_steps)
    return ExitCurve(kind=kind, min_steps=min_steps, T=T, images=N,
                     accuracy_fixed=100.0 * int(right[:, -1].sum()) / N, thresholds=thresholds,
                     accuracy=[100.0 * n / N for n in rights], mean_steps=[s / N for s in steps], edges=edges)


def _check_kind(kind: Any) -> str:
    if kind not in EXIT_RULES:
        raise ConfigError(f"rule (the kind of exit rule) must be one of {EXIT_RULES}, got {kind!r}")
    return kind


def _check_min_steps(min_steps: Any) -> int:
    return ExitRule(DEFAULT_EXIT_RULE, 0.0, min_steps).min_steps  # validated there


def exit_curves(snn: SpikingNetwork, data: Iterable, *, kinds: Iterable[str] = EXIT_RULES, T: int | None = None,
                min_steps: int = 1, labels: bool = True, device: torch.device | str = "cpu",
                progress: bool = False) -> dict[str, ExitCurve]:
    """Accuracy against mean steps for every threshold of each rule kind, from one fixed-T run.

    Args:
        snn: a converted network, on ``device``.
        data: ``(x, y)`` batches; with ``labels=False`` inputs alone will do, and the network's
            own answers at T are the targets.
        kinds: the rule kinds (:data:`~snnconv.exit_rule.EXIT_RULES`).
        T: the most steps an image runs (default ``snn.T``).
        min_steps: no image stops before this step.
        labels: score against the labels (True) or the fixed-T answers (False).
        device: where the batches go.
        progress: a progress bar over the batches.

    Returns:
        ``{kind: ExitCurve}``.
    """
    T = _T(snn, T)
    kinds = [_check_kind(k) for k in kinds]
    min_steps = _check_min_steps(min_steps)
    obs = _observe(snn, data, T, bool(labels), device, progress)
    return {kind: _curve(obs, kind, min_steps) for kind in kinds}


def calibrate_exit(snn: SpikingNetwork, data: Iterable, *, T: int | None = None,
                   tolerance: float = DEFAULT_TOLERANCE, labels: bool = True, min_steps: int = 1,
                   rule: str = DEFAULT_EXIT_RULE, device: torch.device | str = "cpu", store: bool = True,
                   progress: bool = False) -> ExitCalibration:
    """Choose the early-exit threshold on held-out ``data`` and store it with the network.

    The chosen threshold is the loosest (fewest mean steps) whose accuracy on ``data`` is at
    least the fixed-T accuracy on ``data`` less ``tolerance`` points, and whose every stricter
    setting is too (a looser one that meets the tolerance by chance, between stricter ones
    that miss it, is passed over). Setting for setting, :func:`exit_curves` gives the
    accuracies; the threshold lies halfway between two observed scores, so the rounding of
    another executor does not move an image across it. Where no early exit meets the tolerance
    the threshold is ``inf`` (every image runs T steps).

    With ``store`` (default) the record goes into ``snn.meta["early_exit"]``: saved with the
    network (``snn.save``), and the rule that :meth:`SpikingNetwork.run_with_exit
    <snnconv.snn.network.SpikingNetwork.run_with_exit>`, :func:`evaluate_exit` and ``snnconv
    evaluate`` use by default.

    Args:
        snn: a converted network, on ``device``.
        data: held-out ``(x, y)`` batches (never the test split you report); with
            ``labels=False`` inputs alone will do.
        T: the most steps an image runs (default ``snn.T``).
        tolerance: accuracy (percentage points, >= 0) that early exit may give up.
        labels: right means the label (True), or the network's own answer at T (False: no labels
            needed; the fixed-T "accuracy" is then 100).
        min_steps: no image stops before this step.
        rule: the kind of rule, ``"margin"`` or ``"softmax"`` (:mod:`snnconv.exit_rule`).
        device: where the batches go.
        store: write the record into ``snn.meta``.
        progress: a progress bar over the batches.

    Returns:
        :class:`ExitCalibration` (the rule, the accuracy at T and with the rule, the mean steps,
        the histogram of exit steps, and the whole curve).

    Raises:
        ConfigError: a tolerance, min_steps, rule or T out of range.
        DataError: ``data`` is empty, or unlabelled while ``labels`` is True.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 <= tolerance <= 100:
        raise ConfigError(f"tolerance (accuracy points early exit may give up) must be a number in [0, 100], "
                          f"got {tolerance!r}")
    T = _T(snn, T)
    kind = _check_kind(rule)
    min_steps = _check_min_steps(min_steps)
    obs = _observe(snn, data, T, bool(labels), device, progress)
    curve = _curve(obs, kind, min_steps)
    chosen = curve.loosest(tolerance)
    found = ExitRule(kind, curve.thresholds[chosen], min_steps)
    exits = _exit_steps(obs.scores[kind], found)
    record = ExitCalibration(rule=found, T=T, tolerance=float(tolerance), targets=obs.targets, images=curve.images,
                             accuracy_fixed=curve.accuracy_fixed, accuracy=curve.accuracy[chosen],
                             mean_steps=curve.mean_steps[chosen], histogram=exit_histogram(exits, T), curve=curve)
    if store:
        snn.meta[META_KEY] = record.to_dict()
    return record


def _exit_steps(score: torch.Tensor, rule: ExitRule) -> torch.Tensor:
    """Each image's exit step from its scores ``[N, T]`` under ``rule``."""
    N, T = score.shape
    out = torch.full((N,), T, dtype=torch.long)
    running = torch.ones(N, dtype=torch.bool)
    for k in range(rule.min_steps, T):
        now = running & (score[:, k - 1] >= rule.threshold)
        out[now] = k
        running &= ~now
    return out
