"""Early exit: each image stops at the step where its answer is sure (the rule:
:mod:`snnconv.exit_rule`), calibrated on held-out data and evaluated.

    record = snnconv.calibrate_exit(snn, held_out, tolerance=0.3)   # stored in snn.meta
    result = snnconv.evaluate_exit(snn, test)                       # uses the stored rule
    print(result.accuracy, result.mean_steps, result.histogram)

Calibration runs the network once at the fixed T (time folded into the batch, as
``snn.run``) and derives, from each image's accumulated readout after every step, the accuracy
and the mean steps of *every* threshold and ``min_steps`` at once (:class:`ExitObservation`): an
image that exits at step k has the output of the fixed-T run truncated at k
(:meth:`SpikingNetwork.run_with_exit <snnconv.snn.network.SpikingNetwork.run_with_exit>`), so no
setting needs a run of its own.
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

__all__ = ["ExitEvaluation", "ExitCurve", "ExitCalibration", "ExitObservation", "evaluate_exit", "observe_exits",
           "exit_curves", "calibrate_exit", "DEFAULT_TOLERANCE"]


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

    def to_dict(self, points: int | None = None) -> dict[str, Any]:
        """The curve as plain data (an infinite threshold written ``"inf"``); ``points``: at most
        that many of its points (evenly by index, both ends kept)."""
        n = len(self.accuracy)
        keep = (sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
                if points is not None and points >= 2 and n > points else range(n))
        return {"kind": self.kind, "min_steps": self.min_steps, "T": self.T, "images": self.images,
                "accuracy_fixed": self.accuracy_fixed,
                "thresholds": ["inf" if self.thresholds[i] == math.inf else self.thresholds[i] for i in keep],
                "accuracy": [self.accuracy[i] for i in keep], "mean_steps": [self.mean_steps[i] for i in keep]}


@dataclass(frozen=True)
class ExitCalibration:
    """What :func:`calibrate_exit` chose and why.

    ``rule`` is the setting with the fewest mean steps whose accuracy on the ``images``
    calibration images stays within ``tolerance`` points of the fixed-``T`` accuracy
    (``accuracy_fixed``), as does every stricter threshold's at its ``min_steps``; with it those
    images reach ``accuracy`` in ``mean_steps`` steps on average,
    ``histogram`` counting the images that stopped at step 1, ..., T. ``targets`` says what
    was right: ``"labels"``, or ``"fixed-T answers"`` (the network's own answers at T).
    ``curve``: every threshold of the rule's kind at its ``min_steps`` (:class:`ExitCurve`; not
    stored).
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


@dataclass(frozen=True)
class ExitObservation:
    """All that early-exit calibration needs from one fixed-T run: per image and step
    (``[N, T]``) each rule kind's score and whether the image's answer then was right.

    ``targets`` says what was right: ``"labels"``, or ``"fixed-T answers"`` (the network's own
    answers at T). :func:`observe_exits` makes one; :meth:`curve` and :meth:`calibrate` read it
    for any kind, tolerance and ``min_steps`` without running the network again.
    """

    scores: dict[str, torch.Tensor]
    right: torch.Tensor
    targets: str

    @property
    def T(self) -> int:
        """The steps of the run."""
        return int(self.right.shape[1])

    @property
    def images(self) -> int:
        """The images observed."""
        return int(self.right.shape[0])

    def accuracy_by_step(self) -> list[float]:
        """The accuracy (percent) of every image's answer after each step 1..T (the fixed-T
        runs truncated at each step)."""
        return [100.0 * float(v) for v in self.right.double().mean(0)]

    def curve(self, kind: str, min_steps: int = 1) -> ExitCurve:
        """Accuracy against mean steps for every threshold of ``kind`` (:class:`ExitCurve`)."""
        kind, min_steps = _check_kind(kind), _check_min_steps(min_steps)
        N, T = self.right.shape
        thresholds, edges, rights, steps = _sweep(self.scores[kind], self.right, min_steps)
        return ExitCurve(kind=kind, min_steps=min_steps, T=T, images=N,
                         accuracy_fixed=100.0 * int(self.right[:, -1].sum()) / N, thresholds=thresholds,
                         accuracy=[100.0 * n / N for n in rights], mean_steps=[s / N for s in steps], edges=edges)

    def calibrate(self, kind: str = DEFAULT_EXIT_RULE, tolerance: float = DEFAULT_TOLERANCE,
                  min_steps: int | None = None) -> ExitCalibration:
        """The rule of ``kind`` with the fewest mean steps whose accuracy, and every stricter
        threshold's, is within ``tolerance`` points of the fixed-T accuracy; ``min_steps`` None:
        chosen too, from 1 to T (see :func:`calibrate_exit`)."""
        tolerance = _check_tolerance(tolerance)
        candidates = range(1, self.T + 1) if min_steps is None else [_check_min_steps(min_steps)]
        best: tuple[ExitCurve, int] | None = None
        for m in candidates:
            curve = self.curve(kind, m)
            i = curve.loosest(tolerance)
            if best is None or curve.mean_steps[i] < best[0].mean_steps[best[1]] - 1e-12:
                best = (curve, i)
        assert best is not None
        curve, i = best
        rule = ExitRule(curve.kind, curve.thresholds[i], curve.min_steps)
        exits = _exit_steps(self.scores[curve.kind], rule)
        return ExitCalibration(rule=rule, T=self.T, tolerance=float(tolerance), targets=self.targets,
                               images=self.images, accuracy_fixed=curve.accuracy_fixed, accuracy=curve.accuracy[i],
                               mean_steps=curve.mean_steps[i], histogram=exit_histogram(exits, self.T), curve=curve)


def observe_exits(snn: SpikingNetwork, data: Iterable, *, T: int | None = None, labels: bool = True,
                  device: torch.device | str = "cpu", progress: bool = False) -> ExitObservation:
    """One fixed-T run over ``data``: every image's score of each rule kind after each step, and
    whether its answer then (the arg-max of its accumulated readout over k, as an early-exit run
    gives it) was its label (``labels``), or its own answer at T.

    Args:
        snn: a converted network, on ``device``.
        data: ``(x, y)`` batches; with ``labels=False`` inputs alone will do.
        T: the steps of the run, the most an image runs (default ``snn.T``).
        labels: right means the label (True) or the network's own answer at T (False).
        device: where the batches go.
        progress: a progress bar over the batches.

    Raises:
        DataError: ``data`` is empty, unlabelled while ``labels`` is True, or the readout is not
            ``[B, classes]``.
    """
    T = _T(snn, T)
    scores: dict[str, list[torch.Tensor]] = {kind: [] for kind in EXIT_RULES}
    right = []
    with _evaluating(snn):
        for x, y in progress_bar(_batches(data, "the calibration data", bool(labels)), desc="exit calibration",
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
    return ExitObservation({k: torch.cat(v) for k, v in scores.items()}, torch.cat(right),
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


def _check_kind(kind: Any) -> str:
    if kind not in EXIT_RULES:
        raise ConfigError(f"rule (the kind of exit rule) must be one of {EXIT_RULES}, got {kind!r}")
    return kind


def _check_tolerance(tolerance: Any) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 <= float(tolerance) <= 100:
        raise ConfigError(f"tolerance (accuracy points early exit may give up) must be a number in [0, 100], "
                          f"got {tolerance!r}")
    return float(tolerance)


def _check_min_steps(min_steps: Any) -> int:
    return ExitRule(DEFAULT_EXIT_RULE, 0.0, min_steps).min_steps  # validated there


def exit_curves(snn: SpikingNetwork, data: Iterable, *, kinds: Iterable[str] = EXIT_RULES, T: int | None = None,
                min_steps: int = 1, labels: bool = True, device: torch.device | str = "cpu",
                progress: bool = False) -> dict[str, ExitCurve]:
    """Accuracy against mean steps for every threshold of each rule kind, from one fixed-T run
    (:func:`observe_exits`; its arguments, and ``kinds`` and ``min_steps`` of the curves).

    Returns:
        ``{kind: ExitCurve}``.
    """
    kinds = [_check_kind(k) for k in kinds]
    min_steps = _check_min_steps(min_steps)
    obs = observe_exits(snn, data, T=T, labels=labels, device=device, progress=progress)
    return {kind: obs.curve(kind, min_steps) for kind in kinds}


def calibrate_exit(snn: SpikingNetwork, data: Iterable, *, T: int | None = None,
                   tolerance: float = DEFAULT_TOLERANCE, labels: bool = True, min_steps: int | None = None,
                   rule: str = DEFAULT_EXIT_RULE, device: torch.device | str = "cpu", store: bool = True,
                   progress: bool = False) -> ExitCalibration:
    """Choose the early-exit rule on held-out ``data`` and store it with the network.

    For each ``min_steps`` from 1 to T (or the one given), the loosest threshold whose accuracy
    on ``data`` is at least the fixed-T accuracy on ``data`` less ``tolerance`` points, as is
    every stricter threshold's (a looser one that meets the tolerance by chance, between stricter
    ones that miss it, is passed over); of these the rule with the fewest mean steps. Setting for
    setting, :class:`ExitCurve` gives the accuracies; the threshold lies halfway between two
    observed scores, so the rounding of another executor does not move an image across it. Where
    no early exit meets the tolerance the threshold is ``inf`` (every image runs T steps).

    Choosing ``min_steps`` matters where the first steps' readouts are confidently wrong (a
    network whose deep layers have not fired yet): measured on Fashion-MNIST networks converted
    at T=8, it took the mean steps at a tolerance of 0.3 points from 6.0 to 5.6 (a ResNet), 7.5
    to 4.4 (a small CNN) and 7.9 to 6.5 (a MobileNet) of 8 (benchmarks/README.md, "early_exit").

    With ``store`` (default) the record goes into ``snn.meta["early_exit"]``: saved with the
    network (``snn.save``), and the rule that :meth:`SpikingNetwork.run_with_exit
    <snnconv.snn.network.SpikingNetwork.run_with_exit>`, :func:`evaluate_exit` and ``snnconv
    evaluate`` use by default.

    Args:
        snn: a converted network, on ``device``.
        data: held-out ``(x, y)`` batches (never the test split you report); with
            ``labels=False`` inputs alone will do.
        T: the most steps an image runs (default ``snn.T``).
        tolerance: accuracy (percentage points, >= 0) that early exit may give up on ``data``;
            on other images expect it within their sampling noise.
        labels: right means the label (True), or the network's own answer at T (False: no labels
            needed; the fixed-T "accuracy" is then 100).
        min_steps: no image stops before this step; None (default): chosen too.
        rule: the kind of rule, ``"margin"`` or ``"softmax"`` (:mod:`snnconv.exit_rule`).
        device: where the batches go.
        store: write the record into ``snn.meta``.
        progress: a progress bar over the batches.

    Returns:
        :class:`ExitCalibration` (the rule, the accuracy at T and with the rule, the mean steps,
        the histogram of exit steps, and the curve of the chosen ``min_steps``).

    Raises:
        ConfigError: a tolerance, min_steps, rule or T out of range.
        DataError: ``data`` is empty, or unlabelled while ``labels`` is True.
    """
    kind = _check_kind(rule)
    if min_steps is not None:
        min_steps = _check_min_steps(min_steps)
    tolerance = _check_tolerance(tolerance)
    record = observe_exits(snn, data, T=T, labels=labels, device=device, progress=progress).calibrate(
        kind, tolerance, min_steps)
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
