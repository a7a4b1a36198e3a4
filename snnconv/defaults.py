"""convert()'s defaults, decided before the work.

:func:`plan_conversion` takes the settings (:class:`~snnconv.config.ConvertConfig`, resolved),
what the traced model holds (:class:`GraphFacts`) and what the loader holds
(:class:`LoaderFacts`), and returns the :class:`ConversionPlan`: whether and how long to
fine-tune and in which batches, the QCFS training, the layer-wise reconstruction, the
max-pooling mode and the calibration horizon, each default with the reason ``meta.settings``
records. It reads nothing else: the loader is read once into its facts, the model once. The
measurements behind each constant are the rows of benchmarks/README.md, "Defaults".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from snnconv.activation import max_pools
from snnconv.config import ConvertConfig
from snnconv.data import split_steps
from snnconv.plan import epoch_steps
from snnconv.stages.qcfs import QCFSTrainConfig

__all__ = ["CONVERT_FINETUNE", "FINETUNE_MAX_STEPS", "FINETUNE_MIN_STEPS", "FINETUNE_MAX_EPOCHS",
           "FINETUNE_UP_TO_T", "ANYTIME_FROM_T", "RECONSTRUCT_STEPS", "LABEL_FREE_DISTILL", "QCFS_STEPS", "LoaderFacts",
           "GraphFacts", "ConversionPlan", "plan_conversion", "finetune_recipe", "default_finetune_epochs",
           "anytime_horizons", "later_maxpool"]

#: convert()'s fine-tuning recipe, the rest as :class:`FinetuneConfig` (:func:`finetune_recipe`;
#: Defaults rows "distillation, thresholds, surrogate, lr", "batch size" and "keep_start").
CONVERT_FINETUNE: dict[str, Any] = {"alpha": 4.0, "lr": 2e-3, "train_thresholds": True, "distill": 0.5,
                                    "batch_size": 64, "keep_start": True}

#: Steps an epoch keeps by smaller batches, and the smallest batch (Defaults row "batch size").
_FINETUNE_STEPS, _FINETUNE_MIN_BATCH = 256, 16

#: Optimiser steps of one fine-tuning epoch at most (Defaults row "its budget").
FINETUNE_MAX_STEPS = 2000

#: Whole epochs of fine-tuning until this many steps, 1 to FINETUNE_MAX_EPOCHS (Defaults row
#: "its budget").
FINETUNE_MIN_STEPS = 512
FINETUNE_MAX_EPOCHS = 8

#: The largest target T that convert() fine-tunes by default (Defaults row "fine-tuning").
FINETUNE_UP_TO_T = 8

#: From this target T on, convert()'s fine-tuning trains every readout from the first step
#: (:func:`anytime_horizons`), not only T/2, T and 2T, and is judged on them all and not worse
#: at T beyond the noise: the network answers after a step or two as well, for early exit
#: (Defaults row "anytime readouts").
ANYTIME_FROM_T = 8

#: Steps of the layer-wise reconstruction where neither QCFS training nor fine-tuning runs
#: (:func:`snnconv.calibration.reconstruct`; Defaults row "layer-wise reconstruction").
RECONSTRUCT_STEPS = 300

#: Distillation weight without labels (Defaults row "fine-tuning without labels").
LABEL_FREE_DISTILL = 1.0


def finetune_recipe(T: int, loader: Any = None, *, epochs: int = 1, seed: int = 0,
                    max_steps: int | None = FINETUNE_MAX_STEPS, reset: str = "subtract",
                    anytime: bool | None = None, **changes: Any):
    """The :class:`FinetuneConfig` that ``convert(..., T=T)`` fine-tunes with.

    BPTT through ``2 * T`` steps, readouts trained at ``T // 2``, ``T`` and ``2 * T`` (the
    network answers well from half its steps to twice them), and with ``anytime`` (None: from
    ``T >=`` :data:`ANYTIME_FROM_T`) at every power of two from the first step as well
    (:func:`anytime_horizons`), :data:`CONVERT_FINETUNE`, a batch
    from :func:`_finetune_batch` and at most ``max_steps`` optimiser steps per epoch. Hard-reset
    networks (``reset="zero"``) train with the reset detached from the graph (Defaults row
    "detach_reset"). ``changes`` override single fields.
    """
    from snnconv.stages.finetune import FinetuneConfig

    recipe = dict(CONVERT_FINETUNE)
    if loader is not None:
        recipe["batch_size"] = _finetune_batch(loader, recipe["batch_size"], FinetuneConfig.val_fraction)
    if anytime is None:
        anytime = T >= ANYTIME_FROM_T
    horizons = anytime_horizons(T) if anytime else tuple(sorted({max(1, T // 2), T, 2 * T}))
    recipe.update(epochs=epochs, T=2 * T, horizons=horizons, seed=seed, max_steps_per_epoch=max_steps,
                  detach_reset=reset == "zero")
    recipe.update(changes)
    return FinetuneConfig(**recipe)


def anytime_horizons(T: int) -> tuple[int, ...]:
    """The readouts that fine-tuning for early exit trains: every power of two up to ``2 * T``,
    and ``T`` (``(1, 2, 4, 8, 16)`` at T=8): the network answers well from the first step."""
    steps = {T, 2 * T}
    h = 1
    while h <= 2 * T:
        steps.add(h)
        h *= 2
    return tuple(sorted(steps))


def _finetune_batch(loader: Any, batch: int, val_fraction: float) -> int:
    """convert()'s fine-tuning batch size: ``batch``, halved (down to
    :data:`_FINETUNE_MIN_BATCH`) while one epoch of the training split would have fewer than
    :data:`_FINETUNE_STEPS` steps, and never larger than the loader's own batches. A loader
    without a sized dataset is fine-tuned in its own batches anyway."""
    try:
        images = len(loader.dataset) * (1.0 - val_fraction)
    except (AttributeError, TypeError):
        images = math.inf
    while batch > _FINETUNE_MIN_BATCH and images / batch < _FINETUNE_STEPS:
        batch //= 2
    own = getattr(loader, "batch_size", None)
    return own if isinstance(own, int) and own < batch else batch


def _batches_below(loader: Any, n: int) -> bool:
    """Whether ``loader`` yields fewer than ``n`` batches (its length, else reading at most n)."""
    try:
        return len(loader) < n
    except TypeError:
        with torch.random.fork_rng(devices=[]):
            return sum(1 for _ in zip(range(n), loader)) < n


#: QCFS training steps where ``maxpool="avg"`` replaced max-pooling (:func:`_qcfs_epochs`;
#: Defaults row "QCFS training").
QCFS_STEPS = 576


#: The QCFS training of the hard-reset staircase (Defaults row "hard-reset rate"): SGD at
#: lr 0.01 diverged on its straight-through gradient.
HARD_RATE_TRAIN: dict[str, Any] = {"optimizer": "adamw", "lr": 1e-3}


def _qcfs_epochs(loader: Any) -> int:
    """Epochs that hold :data:`QCFS_STEPS` steps over the training split of ``loader`` (its
    validation split held out), between 1 and 64 (a tiny loader: each epoch is also a
    validation pass); 16 (the matrix's) for a loader without a length."""
    steps = split_steps(loader, QCFSTrainConfig.val_fraction)
    return 16 if steps is None else min(64, max(1, math.ceil(QCFS_STEPS / max(1, steps))))


def _hard_rate_default(cfg: ConvertConfig, data: LoaderFacts) -> tuple[bool, str]:
    """``hard_rate=None``: on for ``reset="zero"`` where QCFS training can adapt the ANN to the
    staircase (a loader of two batches or more, ``qcfs_epochs`` not 0); and why."""
    if data.one_batch:
        return False, "off: the loader has one batch (none to train and validate the staircase on)"
    if cfg.qcfs_epochs == 0 or (cfg.qcfs_train is not None and cfg.qcfs_train.epochs == 0):
        return False, "off: qcfs_epochs=0 (the untrained staircase is a poor reference)"
    return True, "on: reset='zero'"


def _finetune_default(cfg: ConvertConfig, data: LoaderFacts) -> tuple[int, str]:
    """``finetune_epochs=None``: for a loader of two batches or more at
    ``T <= FINETUNE_UP_TO_T``, the epochs that reach :data:`FINETUNE_MIN_STEPS` steps
    (:func:`default_finetune_epochs`), none otherwise; and why."""
    why = None
    if cfg.T > FINETUNE_UP_TO_T:
        why = f"T={cfg.T} > {FINETUNE_UP_TO_T}"
    elif data.one_batch:
        why = "the loader has one batch (none to validate on)"
    if why:
        return 0, f"none: {why}"
    epochs = data.finetune_epochs
    source = "labelled" if data.labelled else "no labels: distilled from the ANN's outputs alone"
    return epochs, (f"{epochs} epoch(s), at least {FINETUNE_MIN_STEPS} steps where the data hold them "
                    f"(T <= {FINETUNE_UP_TO_T}, {source})")


def _reconstruction_default(cfg: ConvertConfig, qcfs_trained: bool = False) -> tuple[int, str]:
    """``reconstruction_steps=None``: :data:`RECONSTRUCT_STEPS` where no QCFS training ran, at
    ``T <= FINETUNE_UP_TO_T`` with subtractive reset and bias calibration (where fine-tuning
    follows, it starts from the reconstructed network, the training-free conversion); none
    otherwise; and why."""
    why = None
    if qcfs_trained:
        why = "QCFS training ran"
    elif cfg.T > FINETUNE_UP_TO_T:
        why = f"T={cfg.T} > {FINETUNE_UP_TO_T}"
    elif cfg.reset != "subtract":
        why = f"reset={cfg.reset!r}"
    elif not cfg.bias_calibration:
        why = "bias_calibration=False"
    if why:
        return 0, f"none: {why}"
    return RECONSTRUCT_STEPS, f"{RECONSTRUCT_STEPS} steps (no QCFS training, T <= {FINETUNE_UP_TO_T})"


def default_finetune_epochs(loader: Any) -> int:
    """Whole epochs of convert()'s fine-tuning (its batch size, at most
    :data:`FINETUNE_MAX_STEPS` steps each) that reach :data:`FINETUNE_MIN_STEPS` steps, between
    1 and :data:`FINETUNE_MAX_EPOCHS`; 1 for a loader without a length."""
    from snnconv.stages.finetune import FinetuneConfig

    vf = FinetuneConfig.val_fraction
    batch = _finetune_batch(loader, CONVERT_FINETUNE["batch_size"], vf)
    per = epoch_steps(loader, vf, batch if hasattr(loader, "dataset") else None)
    if per is None:
        return 1
    return min(FINETUNE_MAX_EPOCHS, max(1, math.ceil(FINETUNE_MIN_STEPS / min(per, FINETUNE_MAX_STEPS))))


def later_maxpool(maxpool: str) -> str:
    """The max-pooling mode past the static analog prefix: ``"auto"`` keeps the prefix's
    max-pooling (:mod:`snnconv.constructs.prefix`) and makes every later one average pooling."""
    return "avg" if maxpool == "auto" else maxpool


@dataclass(frozen=True)
class LoaderFacts:
    """What convert()'s defaults read of the loader, read once (:meth:`of`)."""

    labelled: bool           # its first batch has labels
    one_batch: bool          # fewer than two batches: none to validate a fine-tuning on
    finetune_batch: int      # the fine-tuning's batch size (:func:`_finetune_batch`)
    finetune_epochs: int     # the epochs that reach FINETUNE_MIN_STEPS (:func:`default_finetune_epochs`)
    qcfs_epochs: int         # the epochs that hold QCFS_STEPS (:func:`_qcfs_epochs`)

    @classmethod
    def of(cls, loader: Any, labelled: bool) -> "LoaderFacts":
        from snnconv.stages.finetune import FinetuneConfig

        return cls(labelled=labelled, one_batch=_batches_below(loader, 2),
                   finetune_batch=_finetune_batch(loader, CONVERT_FINETUNE["batch_size"],
                                                  FinetuneConfig.val_fraction),
                   finetune_epochs=default_finetune_epochs(loader), qcfs_epochs=_qcfs_epochs(loader))


@dataclass(frozen=True)
class GraphFacts:
    """What convert()'s defaults read of the traced model: the max-pooling modules left past the
    static analog prefix (after the constructs' rewrites)."""

    max_pools: tuple[str, ...] = ()

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "GraphFacts":
        return cls(max_pools=tuple(max_pools(gm)))


@dataclass(frozen=True)
class ConversionPlan:
    """What convert() will run: ``config`` with every default resolved (``finetune_epochs``,
    ``maxpool``, ``reconstruction_steps``, ``bias_calibration_T``), the QCFS training and the
    fine-tuning settings (None: the stage does not train), why each default was chosen, and per
    budget whether it is convert()'s default (only those are cut to the time budgets,
    :func:`snnconv.plan.make_plan`)."""

    config: ConvertConfig
    qcfs_train: Any = None
    finetune: Any = None
    reasons: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, bool] = field(default_factory=dict)

    @property
    def finetunes(self) -> bool:
        """Whether BPTT fine-tuning runs."""
        return self.finetune is not None and self.finetune.epochs > 0

    @property
    def qcfs_trains(self) -> bool:
        """Whether QCFS training runs."""
        return self.qcfs_train is not None and self.qcfs_train.epochs > 0

    @property
    def anytime(self) -> bool:
        """Whether fine-tuning trains readouts before ``T // 2`` as well as at ``T``: it is then
        judged on every readout it trains, and not worse at ``T`` beyond the noise."""
        horizons, T = (self.finetune.horizons if self.finetune is not None else None) or (), self.config.T
        return T in horizons and min(horizons) < max(1, T // 2)

    def cut(self, qcfs_train: Any, finetune: Any, reconstruction_steps: int) -> "ConversionPlan":
        """The plan with the budgets that the time plan cut."""
        return replace(self, qcfs_train=qcfs_train, finetune=finetune,
                       config=self.config.replace(reconstruction_steps=reconstruction_steps))


def plan_conversion(config: ConvertConfig, graph: GraphFacts, data: LoaderFacts) -> ConversionPlan:
    """Every default of convert() that depends on the data or the graph, decided from ``config``
    (resolved: :meth:`ConvertConfig.resolved`), ``graph`` and ``data`` alone."""
    cfg, reasons = config, {}
    defaults = {"finetune": cfg.finetune_epochs is None and cfg.finetune_config is None,
                "qcfs": cfg.qcfs_epochs is None and cfg.qcfs_train is None,
                "reconstruction": cfg.reconstruction_steps is None}
    # without labels the ANN's outputs are the only targets (LABEL_FREE_DISTILL)
    targets: dict[str, Any] = {} if data.labelled else {"distill": LABEL_FREE_DISTILL}
    finetune = cfg.finetune_config
    if defaults["finetune"]:
        epochs, reasons["finetune_default"] = _finetune_default(cfg, data)
        cfg = cfg.replace(finetune_epochs=epochs)
    if finetune is None and cfg.finetune_epochs:
        # every readout from the first step from ANYTIME_FROM_T on, and for early exit at any T
        # (Defaults rows "anytime readouts" and "early exit")
        finetune = finetune_recipe(cfg.T, epochs=cfg.finetune_epochs, seed=cfg.seed, max_steps=FINETUNE_MAX_STEPS,
                                   reset=cfg.reset, batch_size=data.finetune_batch,
                                   anytime=True if cfg.early_exit else None, **targets)
    if cfg.maxpool == "auto":
        cfg = cfg.replace(maxpool=later_maxpool(cfg.maxpool))
    if cfg.hard_rate is None and cfg.reset == "zero":
        hard_rate, reasons["hard_rate_default"] = _hard_rate_default(cfg, data)
        cfg = cfg.replace(hard_rate=hard_rate)
    elif cfg.hard_rate is None:
        cfg = cfg.replace(hard_rate=False)
    qcfs_train = cfg.qcfs_train
    if qcfs_train is None and cfg.qcfs_epochs:
        qcfs_train = QCFSTrainConfig(epochs=cfg.qcfs_epochs, seed=cfg.seed, **targets)
    elif qcfs_train is None and cfg.qcfs_epochs is None and (cfg.hard_rate or cfg.maxpool == "avg" and graph.max_pools):
        # max-pooling became average pooling, or the hard-reset rate replaced QCFS: other
        # functions, which QCFS training adapts the weights to (the staircase with AdamW:
        # HARD_RATE_TRAIN)
        qcfs_train = QCFSTrainConfig(epochs=data.qcfs_epochs, max_steps=QCFS_STEPS, seed=cfg.seed, **targets,
                                     **(HARD_RATE_TRAIN if cfg.hard_rate else {}))
    plan = ConversionPlan(cfg, qcfs_train, finetune, reasons, defaults)
    if cfg.reconstruction_steps is None:
        steps, reasons["reconstruction_default"] = _reconstruction_default(cfg, plan.qcfs_trains)
        cfg = cfg.replace(reconstruction_steps=steps)
    if plan.qcfs_trains and cfg.membrane_calibration:
        # trained at L levels: calibrate against that function, over L steps
        cfg = cfg.replace(bias_calibration_T=cfg.L)
    return replace(plan, config=cfg)
