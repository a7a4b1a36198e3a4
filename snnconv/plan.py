"""The plan of a conversion before its training-style work: which stages run, how many steps,
the time each should take on this device, and how to make it cheaper.

:func:`make_plan` times one step of each training-style stage on an image or a batch (the QCFS
training's ANN step, the reconstruction's and the fine-tuning's BPTT steps on a provisional
network converted from one batch) and extrapolates to the planned steps. A default budget whose
estimate passes its time budget (:data:`TIME_BUDGETS`) is cut to fit, and the plan says so; a
budget the caller set is never changed. :func:`planned_work` counts the steps, :func:`record_run`
writes what ran beside it.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from snnconv.data import split_steps
from snnconv.errors import SnnconvError
from snnconv.memory import TRAINING_FACTOR, budget_bytes, gib, images_that_fit, saved_bytes, step_budget
from snnconv.meta import ConversionMeta
from snnconv.vocabulary import StageName

__all__ = ["TIME_BUDGETS", "MIN_STEPS", "StageEstimate", "WorkEstimate", "make_plan", "log_plan", "planned_work",
           "record_run", "epoch_steps"]

logger = logging.getLogger("snnconv.plan")

#: Seconds a default training-style budget may take on this device before its steps are cut to
#: fit (benchmarks/README.md, Defaults row "time budgets").
TIME_BUDGETS = {"qcfs": 2 * 3600.0, "reconstruction": 3600.0, "finetune": 4 * 3600.0}

#: The fewest steps a cut leaves.
MIN_STEPS = 16

#: Above this estimate of the whole conversion (seconds, at the default budgets before any
#: cut), a plan on a CPU says that the model needs a GPU.
NEEDS_GPU = 8 * 3600.0

#: The reconstruction's images per step (as :data:`snnconv.calibration.reconstruct.RECONSTRUCT_BATCH`).
_RECONSTRUCT_BATCH = 32

#: A one-image step cheaper than this (seconds per batch) is timed on the batch itself.
_CHEAP = 2.0


def epoch_steps(loader: Any, val_fraction: float, batch: int | None = None) -> int | None:
    """Optimiser steps in one epoch of ``loader``'s training split (in batches of ``batch``,
    else the loader's own); None for a loader without a length."""
    try:
        if batch is not None:
            return max(1, int(len(loader.dataset) * (1.0 - val_fraction)) // batch)
        return max(1, int(len(loader) * (1.0 - val_fraction)))
    except (AttributeError, TypeError):
        return None


def planned_work(loader: Any, qcfs_train: Any, finetune_config: Any) -> dict[str, Any]:
    """The planned work of the training stages in optimiser steps (None: as long as the loader
    runs), and one ANN training epoch over ``loader`` (its length) as the unit to compare with."""
    try:
        ann_epoch = len(loader)
    except TypeError:
        ann_epoch = None
    out: dict[str, Any] = {"ann_epoch_steps": ann_epoch, "qcfs_steps": 0, "finetune_steps": 0}
    if qcfs_train is not None and qcfs_train.epochs:
        per = split_steps(loader, qcfs_train.val_fraction)
        steps = None if per is None else qcfs_train.epochs * max(1, per)
        if qcfs_train.max_steps is not None:
            steps = qcfs_train.max_steps if steps is None else min(steps, qcfs_train.max_steps)
        out["qcfs_steps"] = steps
    if finetune_config is not None and finetune_config.epochs:
        cfg = finetune_config
        per = epoch_steps(loader, cfg.val_fraction, cfg.batch_size if hasattr(loader, "dataset") else None)
        if cfg.max_steps_per_epoch:
            per = cfg.max_steps_per_epoch if per is None else min(per, cfg.max_steps_per_epoch)
        out["finetune_steps"] = None if per is None else cfg.epochs * per
        out["finetune_T"] = cfg.T
    return out


def record_run(meta: ConversionMeta) -> None:
    """What the training stages ran: optimiser steps and seconds, beside the plan."""
    budget = meta.settings.get("budget", {})
    for record in meta.stages:
        if record.name == StageName.QCFS and record.changes.get("history"):
            budget["qcfs_steps_run"] = sum(h.get("steps", 0) for h in record.changes["history"])
            budget["qcfs_seconds"] = record.seconds
        if record.name == StageName.SPIKING and "reconstruction" in record.changes:
            budget["reconstruction_steps_run"] = record.changes["reconstruction"]["steps"]
            budget["reconstruction_seconds"] = record.changes["reconstruction"]["seconds"]
        if record.name == StageName.FINETUNE:
            budget["finetune_steps_run"] = record.changes.get("steps", 0)
            budget["finetune_seconds"] = record.seconds
    budget["total_seconds"] = sum(r.seconds for r in meta.stages)


@dataclass
class StageEstimate:
    """One stage of the plan: ``steps`` of ``images`` each at ``T`` time steps (T=1: the ANN),
    ``seconds_per_step`` measured here, ``seconds`` in all; ``cut_from``: the default steps
    before a time budget cut them; ``micro_batch``: images per pass that fit the memory."""

    name: str
    steps: int | None
    images: int
    T: int
    seconds_per_step: float | None = None
    seconds: float | None = None
    cut_from: int | None = None
    micro_batch: int | None = None
    note: str = ""


@dataclass
class WorkEstimate:
    """What a conversion will do and what it should cost here (:func:`make_plan`)."""

    device: str
    stages: list[StageEstimate] = field(default_factory=list)
    cheaper: list[str] = field(default_factory=list)
    needs_gpu: str = ""
    measure_seconds: float = 0.0
    memory_budget: int | None = None

    @property
    def seconds(self) -> float | None:
        known = [s.seconds for s in self.stages if s.seconds is not None]
        return sum(known) if known else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = self.seconds
        return out

    def summary(self) -> str:
        """The plan in a few lines, for a log."""
        lines = [f"snnconv plan on {self.device} (one step of each stage measured, "
                 f"{self.measure_seconds:.0f} s; memory budget {gib(self.memory_budget)}):"]
        for s in self.stages:
            # fine-tuning unrolls BPTT over its own horizon (2T by default), not the network's T
            bptt = s.name == StageName.FINETUNE
            what = "ANN" if s.T == 1 else (f"BPTT through {s.T} time steps" if bptt else f"T={s.T}")
            steps = "unknown number of" if s.steps is None else str(s.steps)
            if s.name == "calibration":
                line = f"  {s.name}: one pass over {s.images} image(s) at {what}"
            else:
                at = "," if s.name == StageName.FINETUNE else " at"
                line = f"  {s.name}: {steps} step(s) of {s.images} image(s){at} {what}"
                if s.seconds_per_step is not None:
                    line += f", {_duration(s.seconds_per_step)} a step"
            if s.micro_batch is not None and s.micro_batch < s.images:
                line += f" (in micro-batches of {s.micro_batch})"
            if s.seconds is not None:
                line += f": about {_duration(s.seconds)}"
            if s.cut_from is not None:
                line += (f" (cut from the default {s.cut_from} steps, about "
                         f"{_duration((s.seconds_per_step or 0.0) * s.cut_from)}, to the "
                         f"{_duration(TIME_BUDGETS[s.name])} budget)")
            if s.note:
                line += f"; {s.note}"
            lines.append(line)
        if self.seconds is not None:
            lines.append(f"  in all: about {_duration(self.seconds)} on this device")
        if self.needs_gpu:
            lines.append("  " + self.needs_gpu)
        if self.cheaper:
            lines.append("  cheaper: " + "; ".join(self.cheaper))
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _step_time(step: Callable[[torch.Tensor], Any], x: torch.Tensor, batch: int,
               first: float | None = None, fit: int | None = None) -> float:
    """Seconds of ``step`` on ``batch`` images. Timed on one image and on two (after one call
    to warm up): where the second image adds little (a fixed cost per step dominates: small
    images) and that is cheap, or where the step is cheap, the batch itself (as much of it as
    ``x`` holds) is timed and scaled; else the line through the two is extended (a cost per image dominates: large
    images, where one image already takes long). ``first``: the seconds of a call on one image
    made already (the warm-up; where it took a second or more, its own time is taken).
    ``fit``: the most images one call may take (the memory)."""
    if first is None:
        first = _timed(lambda: step(x[:1]))
    one = first if first >= 1.0 else _timed(lambda: step(x[:1]))
    n = min(batch, len(x), fit or batch)
    if n < 2:
        return one * batch
    if one * batch <= _CHEAP:
        return _timed(lambda: step(x[:n])) * batch / n
    two = _timed(lambda: step(x[:2]))
    if two < 1.5 * one and two * n / 2 <= 5 * _CHEAP:
        return _timed(lambda: step(x[:n])) * batch / n
    return one + max(0.0, two - one) * (batch - 1)


def _train_step(model: nn.Module) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        out = model(x)
        out.float().square().mean().backward()
        for p in model.parameters():
            p.grad = None
    return step


def _provisional_snn(gm: nn.Module, x: torch.Tensor, cfg: Any) -> nn.Module:
    """A spiking network of ``gm`` from one batch's thresholds: the shape of the real one, for
    timing (no calibration)."""
    from snnconv.constructs.pools import rewrite_ceil_pools
    from snnconv.stages.qcfs import calibrate_qcfs
    from snnconv.stages.spiking import to_spiking

    x = x[:2]
    qgm = calibrate_qcfs(gm, [x], L=cfg.L, per_channel=cfg.per_channel, num_batches=1, maxpool=cfg.maxpool,
                         device=x.device, progress=False)
    rewrite_ceil_pools(qgm, (x,))
    return to_spiking(qgm, T=cfg.T, reset=cfg.reset)


def _cut(stage: StageEstimate, budget: float) -> int | None:
    """Steps of ``stage`` that fit ``budget`` seconds (None: no cut needed)."""
    if stage.seconds is None or stage.steps is None or stage.seconds <= budget or not stage.seconds_per_step:
        return None
    fit = max(MIN_STEPS, int(budget // stage.seconds_per_step))
    return fit if fit < stage.steps else None


def make_plan(gm: nn.Module, calib: list, cfg: Any, *, qcfs_train: Any, finetune_config: Any,
              budget: dict[str, Any], defaults: dict[str, bool], device: torch.device,
              val_images: int | None = None) -> tuple[WorkEstimate, Any, Any, int]:
    """Measure one step of each training-style stage and plan them; cut a default budget
    (``defaults[stage]``) whose estimate passes :data:`TIME_BUDGETS`.

    Args:
        gm: the folded ANN (not changed).
        calib: the calibration batches ``(x, y)``.
        cfg: the resolved :class:`~snnconv.config.ConvertConfig`.
        qcfs_train, finetune_config: the stages' settings (None: the stage does not run).
        budget: :func:`planned_work`'s steps.
        defaults: per stage, whether its budget is convert()'s default (only those are cut).
        val_images: images of the fine-tuning's validation split.

    Returns:
        ``(plan, qcfs_train, finetune_config, reconstruction_steps)``, the settings cut where
        a budget was.
    """
    start = time.perf_counter()
    plan = WorkEstimate(device=str(device), memory_budget=budget_bytes(device))
    x = calib[0][0].to(device)
    images = sum(len(b[0]) for b in calib)
    snn_needed = bool(cfg.reconstruction_steps) or (finetune_config is not None and finetune_config.epochs > 0)
    steps_r = cfg.reconstruction_steps
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        snn = None
        if snn_needed:
            try:
                snn = _provisional_snn(gm, x, cfg).to(device)
            except (SnnconvError, RuntimeError, ValueError) as exc:
                plan.cheaper.append(f"(the spiking stages were not timed: {type(exc).__name__}: {str(exc)[:120]})")
        # the calibration: one forward of its images at its horizon, about 1.5x with the weight fit
        if snn is not None and cfg.bias_calibration:
            horizon = max(cfg.horizons) if cfg.horizons else (cfg.bias_calibration_T or cfg.T)
            n_bias = sum(len(b[0]) for b in calib[:cfg.bias_batches])
            forward = _forward_time(snn, x, horizon, n_bias)
            plan.stages.append(StageEstimate("calibration", 1, n_bias, horizon, forward * 1.5, forward * 1.5,
                                         note="all images in one pass where they fit the memory"))
        if qcfs_train is not None and qcfs_train.epochs:
            ann = copy.deepcopy(gm).train()
            per = _step_time(_train_step(ann), x, len(x))
            del ann
            plan.stages.append(_stage("qcfs", budget.get("qcfs_steps"), len(x), 1, per))
        if steps_r and snn is not None:
            batch = min(_RECONSTRUCT_BATCH, images)
            per, micro = _snn_step(snn, x, cfg.T, batch)
            plan.stages.append(_stage("reconstruction", steps_r, batch, cfg.T, per, micro))
        if finetune_config is not None and finetune_config.epochs and snn is not None:
            batch = finetune_config.batch_size or len(x)
            per, micro = _snn_step(snn, x, finetune_config.T, batch)
            stage = _stage("finetune", budget.get("finetune_steps"), batch, finetune_config.T, per, micro)
            val = 0.0
            if val_images and stage.seconds is not None:
                val = _forward_time(snn, x, finetune_config.T, val_images)
                stage.seconds += val * _val_passes(finetune_config)
                stage.note = f"with {_val_passes(finetune_config)} validation pass(es) over {val_images} images"
            plan.stages.append(stage)
    before_cuts = plan.seconds
    for stage in plan.stages:
        fit = _cut(stage, TIME_BUDGETS[stage.name]) if stage.name in TIME_BUDGETS and defaults.get(stage.name) else None
        if fit is None:
            continue
        # a stage is cut only where its steps were counted and a step was timed (_cut)
        assert stage.steps is not None and stage.seconds_per_step is not None
        stage.cut_from = stage.steps
        if stage.name == StageName.QCFS:
            qcfs_train = replace(qcfs_train, max_steps=fit)
        elif stage.name == "reconstruction":
            steps_r = fit
        else:  # fine-tuning: whole epochs where they hold
            finetune_config, fit = _cut_finetune(finetune_config, fit, stage.cut_from)
        stage.steps = fit
        stage.seconds = stage.seconds_per_step * fit + (
            val * _val_passes(finetune_config) if stage.name == StageName.FINETUNE else 0.0)
    _advice(plan, cfg, before_cuts, device)
    plan.measure_seconds = time.perf_counter() - start
    return plan, qcfs_train, finetune_config, steps_r


def _stage(name: str, steps: int | None, images: int, T: int, per: float, micro: int | None = None) -> StageEstimate:
    return StageEstimate(name, steps, images, T, per, None if steps is None else per * steps, micro_batch=micro)


def _snn_step(snn: Any, x: torch.Tensor, T: int, batch: int) -> tuple[float, int]:
    """Seconds of one BPTT step of ``batch`` images at ``T`` and the images per pass that fit."""
    old = snn.T
    snn.T = T
    snn.train()
    step, kept = _train_step(snn), []
    try:
        # the warm-up step measures what autograd keeps for one image
        first = _timed(lambda: kept.append(saved_bytes(lambda: step(x[:1]), snn)))
        per_image = int(TRAINING_FACTOR * kept[0])
        fit = images_that_fit(per_image, step_budget(x.device), batch)
        return _step_time(step, x, batch, first, fit), fit
    finally:
        snn.eval()
        snn.T = old


def _forward_time(snn: Any, x: torch.Tensor, T: int, images: int) -> float:
    old = snn.T
    snn.T = T
    try:
        with torch.no_grad():
            return _step_time(snn, x, images)
    finally:
        snn.T = old


def _cut_finetune(config: Any, steps: int, default: int) -> tuple[Any, int]:
    """``config`` cut to at most ``steps`` optimiser steps of its ``default`` (whole epochs
    where they hold, else one shorter epoch), and the steps it then runs."""
    per = math.ceil(default / max(1, config.epochs))
    if steps >= per:
        return replace(config, epochs=steps // per), steps // per * per
    return replace(config, epochs=1, max_steps_per_epoch=steps), steps


def _val_passes(config: Any) -> int:
    """Validation passes of a fine-tuning: one an epoch, and the start's with ``keep_start``."""
    return config.epochs + int(config.keep_start)


def _advice(plan: WorkEstimate, cfg: Any, before_cuts: float | None, device: torch.device) -> None:
    """How to make this conversion cheaper, from its own stages."""
    names = {s.name for s in plan.stages}
    if "finetune" in names:
        plan.cheaper.append("finetune_epochs=0 (training-free: the calibration, then the layer-wise "
                            "reconstruction) or fewer epochs")
    if "reconstruction" in names:
        plan.cheaper.append("reconstruction_steps=N (fewer steps; 0: none)")
    if "qcfs" in names:
        plan.cheaper.append("qcfs_epochs=0 (max-pooling then averages without training; or maxpool='auto' "
                            "keeps the first one exact)")
    if device.type == "cpu":
        plan.cheaper.append("a GPU (device='cuda')")
    plan.cheaper.append("a smaller input size or T")
    if device.type == "cpu" and before_cuts is not None and before_cuts > NEEDS_GPU:
        plan.needs_gpu = (f"This model needs a GPU at this input size: its default budgets would take "
                          f"about {_duration(before_cuts)} on this CPU.")


def log_plan(plan: WorkEstimate, show: bool) -> None:
    """The plan to the ``snnconv.plan`` logger, and to stderr where ``show``."""
    text = plan.summary()
    logger.info("%s", text)
    if show:
        print(text, file=sys.stderr, flush=True)
