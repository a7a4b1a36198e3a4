"""convert(): the only place that knows the stage order.

prepare -> fold -> guard -> QCFS -> guard -> IF -> guard [-> BPTT fine-tune -> guard]
"""

from __future__ import annotations

import collections.abc
import contextlib
import math
import random
import time
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

from .calibration import calibrate_bias, calibrate_thresholds, reconstruct
from .config import ConvertConfig
from .constructs import rewrite_constructs
from .data import check_labels, generators_kept, split_steps
from .errors import ConfigError, ConversionError, DataError, ResourceError, UnsupportedModelError
from .fold import fold_graph
from .graph import prepare
from .guards import assert_no_batchnorm
from .health import accuracy_of, activity, chance_level, collapse_report, dead_layers
from .meta import ConversionMeta, StageRecord
from .metrics import accuracy_by_T, evaluate
from .network import SpikingNetwork
from .plan import epoch_steps, log_plan, make_plan, planned_work, record_run
from .pools import rewrite_ceil_pools
from .qcfs import QCFSTrainConfig, calibrate_qcfs, check_activations, max_pools
from .replace import to_spiking
from .summary import images_in, say_beyond_ann

__all__ = ["convert", "ConvertConfig", "seed_everything", "draw_batches", "finetune_recipe", "default_finetune_epochs"]

#: convert()'s fine-tuning recipe, the rest as :class:`FinetuneConfig` (:func:`finetune_recipe`;
#: Defaults rows "distillation, thresholds, surrogate, lr", "batch size" and "keep_start").
CONVERT_FINETUNE = {"alpha": 4.0, "lr": 2e-3, "train_thresholds": True, "distill": 0.5, "batch_size": 64,
                    "keep_start": True}

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

#: Steps of the layer-wise reconstruction where neither QCFS training nor fine-tuning runs
#: (:func:`snnconv.calibration.reconstruct`; Defaults row "layer-wise reconstruction").
RECONSTRUCT_STEPS = 300

#: Distillation weight without labels (Defaults row "fine-tuning without labels").
LABEL_FREE_DISTILL = 1.0


def finetune_recipe(T: int, loader: Any = None, *, epochs: int = 1, seed: int = 0,
                    max_steps: int | None = FINETUNE_MAX_STEPS, reset: str = "subtract", **changes: Any):
    """The :class:`FinetuneConfig` that ``convert(..., T=T)`` fine-tunes with.

    BPTT through ``2 * T`` steps, readouts trained at ``T // 2``, ``T`` and ``2 * T`` (the
    network answers well from half its steps to twice them), :data:`CONVERT_FINETUNE`, a batch
    from :func:`_finetune_batch` and at most ``max_steps`` optimiser steps per epoch. Hard-reset
    networks (``reset="zero"``) train with the reset detached from the graph (Defaults row
    "detach_reset"). ``changes`` override single fields.
    """
    from .finetune import FinetuneConfig

    recipe = dict(CONVERT_FINETUNE)
    if loader is not None:
        recipe["batch_size"] = _finetune_batch(loader, recipe["batch_size"], FinetuneConfig.val_fraction)
    horizons = tuple(sorted({max(1, T // 2), T, 2 * T}))
    recipe.update(epochs=epochs, T=2 * T, horizons=horizons, seed=seed, max_steps_per_epoch=max_steps,
                  detach_reset=reset == "zero")
    recipe.update(changes)
    return FinetuneConfig(**recipe)


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


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


#: QCFS training steps where ``maxpool="avg"`` replaced max-pooling (:func:`_qcfs_epochs`;
#: Defaults row "QCFS training").
QCFS_STEPS = 576

def _qcfs_epochs(loader: Any) -> int:
    """Epochs that hold :data:`QCFS_STEPS` steps over the training split of ``loader`` (its
    validation split held out), between 1 and 64 (a tiny loader: each epoch is also a
    validation pass); 16 (the matrix's) for a loader without a length."""
    steps = split_steps(loader, QCFSTrainConfig.val_fraction)
    return 16 if steps is None else min(64, max(1, math.ceil(QCFS_STEPS / max(1, steps))))


def _qcfs_training(cfg: ConvertConfig, gm: nn.Module, health: "_Health", loader: Any) -> QCFSTrainConfig | None:
    """QCFS training settings: ``qcfs_epochs`` epochs, or with ``qcfs_epochs=None`` (default)
    :data:`QCFS_STEPS` steps where ``maxpool="avg"`` replaces max-pooling (a different
    function: on the robustness matrix the QCFS-ANN of a VGG drops from 82-89% to 45-58%
    without it and recovers to 82-89% with them); none otherwise. Without labels it learns from
    the ANN's outputs alone (:data:`LABEL_FREE_DISTILL`)."""
    unlabelled = {} if health.y else {"distill": LABEL_FREE_DISTILL}
    if cfg.qcfs_train is not None:
        return cfg.qcfs_train
    if cfg.qcfs_epochs:
        return QCFSTrainConfig(epochs=cfg.qcfs_epochs, seed=cfg.seed, **unlabelled)
    pools = max_pools(gm) if cfg.qcfs_epochs is None and cfg.maxpool == "avg" else []
    if pools:
        return QCFSTrainConfig(epochs=_qcfs_epochs(loader), max_steps=QCFS_STEPS, seed=cfg.seed,
                               **unlabelled)
    return None


def _plan(meta: ConversionMeta, gm: nn.Module, calib: list, cfg: ConvertConfig, qcfs_train: Any,
          finetune_config: Any, defaults: dict[str, bool], device: torch.device, loader: Any):
    """Measure and log the plan of the training-style stages (:func:`snnconv.plan.make_plan`)
    into ``meta.plan``; the settings of a default budget it cut are recorded as they will run."""
    record = meta.settings
    try:
        val = int(len(loader.dataset) * finetune_config.val_fraction) if finetune_config is not None else None
    except (AttributeError, TypeError):
        val = None
    plan, qcfs_train, finetune_config, steps = make_plan(
        gm, calib, cfg, qcfs_train=qcfs_train, finetune_config=finetune_config, budget=record["budget"],
        defaults=defaults, device=device, val_images=val)
    meta.plan = plan.to_dict()
    log_plan(plan, cfg.progress)
    if any(s.cut_from is not None for s in plan.stages):
        cfg = cfg.replace(reconstruction_steps=steps)
        if qcfs_train is not None:
            record["qcfs_train"] = vars(qcfs_train).copy()
        if finetune_config is not None:
            record["finetune"] = vars(finetune_config).copy()
            record["finetune_epochs"] = finetune_config.epochs
        record["reconstruction_steps"] = steps
        record["budget"] = dict(planned_work(loader, qcfs_train, finetune_config), reconstruction_steps=steps)
    return qcfs_train, finetune_config, cfg


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc)))


@contextlib.contextmanager
def _stage(meta: ConversionMeta, name: str) -> Iterator[StageRecord]:
    record = StageRecord(name)
    start = time.perf_counter()
    try:
        yield record
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, ResourceError) or not _out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ResourceError(
            f"stage '{name}' ran out of memory ({first[:200]}). The stages size their work from "
            "the memory free when they start (snnconv.memory): where other processes took it since, "
            "cap what they plan for with SNNCONV_MEMORY (for example SNNCONV_MEMORY=4G), lower T "
            "or the input size, or run on a device with more memory") from exc
    record.seconds = time.perf_counter() - start
    meta.stages.append(record)


def _check_weights(model: nn.Module) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise UnsupportedModelError(
                f"'{name}' is on the meta device (a model built without its weights); load the "
                "trained state dict (model.load_state_dict(..., assign=True) or model.to_empty() "
                "then load) before converting")
        if t.is_floating_point() and t.dtype != torch.float32:
            raise UnsupportedModelError(
                f"'{name}' is {t.dtype}; convert() computes in float32 (calibration, the spiking "
                "network and its files are float32). Pass model.float() (a copy is fine: "
                "copy.deepcopy(model).float())")
        if t.is_floating_point() and not torch.isfinite(t).all():
            n = (~torch.isfinite(t)).sum().item()
            raise UnsupportedModelError(
                f"'{name}' holds {n} NaN/inf value(s); a converted network would propagate them. "
                "Fix the training run (or the checkpoint) that produced these weights.")


def _check_batch(gm: nn.Module, x: torch.Tensor, y: torch.Tensor | None, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise DataError(f"the loader's inputs are {type(x).__name__}, not tensors")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise DataError(f"the first batch of the loader (shape {tuple(x.shape)}) holds "
                        f"{(~torch.isfinite(x)).sum().item()} NaN/inf value(s); clean the data")
    try:
        with torch.no_grad():
            out = gm(x.to(device))
    except Exception as exc:
        raise DataError(
            f"the model rejects a batch of shape {tuple(x.shape)} and dtype {x.dtype} from the "
            f"loader: {type(exc).__name__}: {exc}. Check that the loader yields the inputs the "
            "model was trained on ([B, C, H, W] for a CNN).") from exc
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise UnsupportedModelError(
            f"the model returns {type(out).__name__} of shape {getattr(out, 'shape', None)}; "
            "convert() expects one [B, classes] tensor")
    if y is not None:
        check_labels(y, out.shape[1], where="the conversion loader")


class _Health:
    """Per-stage activity and the collapse check on a few labelled calibration batches."""

    def __init__(self, batches: list, device: torch.device, on_collapse: str):
        self.x = [x.to(device) for x, _ in batches]
        self.y = [y for _, y in batches]
        if any(y is None for y in self.y):
            self.y = []
        self.chance = chance_level(self.y)
        self.ann_accuracy: float | None = None
        self.reference: dict = {}
        self.on_collapse = on_collapse
        self.finetune_follows = False

    def check(self, rec: StageRecord, model: nn.Module, stage: str,
              what: str = "the network", source: dict[str, str] | None = None, hint: str = "") -> None:
        """Record activity and accuracy of ``model`` after ``stage``; raise or warn on a collapse.

        ``source`` maps each activity site to the ANN ReLU node it came from.
        """
        import warnings

        start = time.perf_counter()
        outputs: list = []
        act = activity(model, self.x, outputs)  # one pass: the activity and the outputs
        acc = accuracy_of(outputs, self.y)
        rec.changes["activity"] = act
        rec.changes["check_accuracy"] = acc
        rec.changes["check_seconds"] = time.perf_counter() - start  # included in the stage's time
        if stage == "fold":
            self.ann_accuracy, self.reference = acc, act
            dead = dead_layers(act)
            if dead:
                rec.changes["dead_in_ann"] = dead
                warnings.warn(f"the ANN has ReLU layer(s) that output zero on every calibration "
                              f"sample: {', '.join(dead)}; their spiking counterparts will be silent "
                              "too (not an error of the conversion)", RuntimeWarning, stacklevel=3)
            return
        findings = collapse_report(act, reference=self.reference, source=source, accuracy=acc,
                                   ann_accuracy=self.ann_accuracy, chance=self.chance)
        if not findings:
            return
        rec.changes["collapse"] = findings
        # A QCFS-ANN with dead or clipped sites is broken thresholds; an SNN with silent deep
        # layers at a small T (or with hard reset) may still be fine-tuned back: there, silent
        # layers alone warn, and only a network at chance is an error.
        fatal = stage == "qcfs" or any(f.startswith("at chance") for f in findings)
        if stage == "spiking" and self.finetune_follows:
            fatal = False  # fine-tuning comes next; its result is checked
        n = sum(len(x) for x in self.x)
        message = (f"after stage '{stage}', {what} collapsed on {n} calibration samples: "
                   + "; ".join(findings) + f". What to do: {hint}try per_channel=True, a larger T, "
                   "bias_calibration=True, or fewer QCFS training epochs / a lower learning rate; "
                   "pass on_collapse='warn' to get the network anyway.")
        if fatal and self.on_collapse == "raise":
            raise ConversionError(message, layers=list(findings))
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def draw_batches(loader: Iterable, n: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The first ``n`` batches of ``loader`` as ``(x, y)`` pairs (``y`` None when unlabelled),
    drawn without moving the global RNG: the calibration batches every stage shares."""
    from .data import SameShape, split_batch

    batches = []
    same = SameShape("the conversion loader")
    with torch.random.fork_rng(devices=[]):
        for batch in loader:
            if len(batches) >= n:
                break
            x, y = split_batch(batch, where="the conversion loader")
            batches.append((same(x, len(batches)), y))
    return batches


def _finetune_default(cfg: ConvertConfig, labelled: bool, loader: Any) -> tuple[int, str]:
    """``finetune_epochs=None``: for a loader of two batches or more at
    ``T <= FINETUNE_UP_TO_T``, the epochs that reach :data:`FINETUNE_MIN_STEPS` steps
    (:func:`default_finetune_epochs`), none otherwise; and why."""
    why = None
    if cfg.T > FINETUNE_UP_TO_T:
        why = f"T={cfg.T} > {FINETUNE_UP_TO_T}"
    elif _batches_below(loader, 2):
        why = "the loader has one batch (none to validate on)"
    if why:
        return 0, f"none: {why}"
    epochs = default_finetune_epochs(loader)
    source = "labelled" if labelled else "no labels: distilled from the ANN's outputs alone"
    return epochs, (f"{epochs} epoch(s), at least {FINETUNE_MIN_STEPS} steps where the data hold them "
                    f"(T <= {FINETUNE_UP_TO_T}, {source})")


def _reconstruction_default(cfg: ConvertConfig, finetune_follows: bool,
                            qcfs_trained: bool = False) -> tuple[int, str]:
    """``reconstruction_steps=None``: :data:`RECONSTRUCT_STEPS` where neither QCFS training ran
    nor fine-tuning follows, at ``T <= FINETUNE_UP_TO_T`` with subtractive reset and bias
    calibration; none otherwise; and why."""
    why = None
    if finetune_follows:
        why = "fine-tuning follows"
    elif qcfs_trained:
        why = "QCFS training ran"
    elif cfg.T > FINETUNE_UP_TO_T:
        why = f"T={cfg.T} > {FINETUNE_UP_TO_T}"
    elif cfg.reset != "subtract":
        why = f"reset={cfg.reset!r}"
    elif not cfg.bias_calibration:
        why = "bias_calibration=False"
    if why:
        return 0, f"none: {why}"
    return RECONSTRUCT_STEPS, (f"{RECONSTRUCT_STEPS} steps (no QCFS training or fine-tuning, "
                               f"T <= {FINETUNE_UP_TO_T})")


def default_finetune_epochs(loader: Any) -> int:
    """Whole epochs of convert()'s fine-tuning (its batch size, at most
    :data:`FINETUNE_MAX_STEPS` steps each) that reach :data:`FINETUNE_MIN_STEPS` steps, between
    1 and :data:`FINETUNE_MAX_EPOCHS`; 1 for a loader without a length."""
    from .finetune import FinetuneConfig

    vf = FinetuneConfig.val_fraction
    batch = _finetune_batch(loader, CONVERT_FINETUNE["batch_size"], vf)
    per = epoch_steps(loader, vf, batch if hasattr(loader, "dataset") else None)
    if per is None:
        return 1
    return min(FINETUNE_MAX_EPOCHS, max(1, math.ceil(FINETUNE_MIN_STEPS / min(per, FINETUNE_MAX_STEPS))))


def _check_loaders(loader: Any, eval_loader: Any) -> None:
    for name, data in (("loader", loader), ("eval_loader", eval_loader)):
        if isinstance(data, collections.abc.Iterator):
            raise DataError(
                f"{name} is a one-shot iterator ({type(data).__name__}); convert() reads it more "
                "than once (checks, calibration, training, evaluation). Pass a DataLoader or a "
                "list of batches instead.")


def convert(model: nn.Module, loader: Iterable, config: ConvertConfig | None = None, *,
            eval_loader: Iterable | None = None, **settings: Any) -> tuple[SpikingNetwork, ConversionMeta]:
    """Convert a trained ReLU network into a spiking network of IF neurons.

    Runs prepare -> fold BatchNorm -> QCFS calibration (and QCFS training where asked) -> IF
    replacement and calibration -> BPTT fine-tuning, with the no-BatchNorm guard after every
    stage. The caller's ``model`` is never changed. By default a target ``T <= 8`` gets whole
    epochs of fine-tuning up to at least :data:`FINETUNE_MIN_STEPS` optimiser steps (one epoch
    of a large data set, at most :data:`FINETUNE_MAX_STEPS` steps each, :func:`finetune_recipe`),
    distilled from ``model``'s outputs alone where the loader has no labels;
    ``finetune_epochs=0`` converts without training, which is also what a loader of one batch
    or ``T >= 16`` gets.
    ``meta.settings`` records every setting as resolved and every default chosen from the data;
    ``meta.settings["budget"]`` the planned optimiser steps of each training stage, the steps
    that ran, their seconds, and the loader's length (one ANN training epoch).

    The returned network is a function of ``model``, the data, the settings and ``seed``:
    evaluation and progress never draw from the RNG that training uses, and a loader that
    shuffles with its own ``generator`` is left in the state it had on the call.

    Args:
        model: a traceable ``nn.Module`` with ReLU activations.
        loader: batches of ``(x, y)``, ``[x, y]`` or bare ``x``; labels are needed only for
            QCFS training and fine-tuning. Validation data is split from it. The first
            ``calib_batches`` batches are drawn once and shared by every calibration.
        config: a :class:`ConvertConfig`; keyword ``settings`` override its fields.
        eval_loader: optional labelled loader (a test set) to record accuracies in ``meta``;
            it is never used to choose anything.

    Settings (keyword arguments, or fields of :class:`ConvertConfig`):
        T: time steps of the returned network (settable later with ``snn.T``), 1 to
            :data:`~snnconv.config.MAX_T`.
        L: QCFS quantisation levels (default ``T``). After QCFS training every calibration
            targets the QCFS-ANN at these L levels over L steps, the function the network was
            trained for. Without QCFS training the default membrane and weight calibration
            target the QCFS-ANN at ``2 * T`` levels; bias-only calibration and ``reset="zero"``
            at L.
        percentile: each QCFS threshold starts at this percentile of its site's activations.
        calib_batches: loader batches for the QCFS thresholds; bias and membrane calibration
            use the first ``min(4, calib_batches)``, all at once for up to ``2 * T`` steps where
            they fit the memory, in groups where not (:func:`snnconv.calibration.calibrate_bias`).
        maxpool: ``"auto"`` (default) keeps the max-pooling of the static analog prefix (the
            layers up to the first max-pooling, such as a ResNet stem, run once in analog,
            exactly: :mod:`snnconv.prefix`) and makes every later one average pooling; ``"avg"``
            makes every one average pooling, a different function, which QCFS training then
            adapts the weights to (see ``qcfs_epochs``); ``"error"`` refuses max-pooling.
        qcfs_epochs: epochs of QCFS-aware training of the ANN (``qcfs_train`` sets the rest;
            with an unlabelled loader the targets are ``model``'s outputs alone). ``None``
            (default): :data:`QCFS_STEPS` optimiser steps (in whole epochs of the training
            split, the last one cut) where ``maxpool="avg"`` replaced max-pooling; none
            otherwise. ``0``: none.
        qcfs_train: a :class:`QCFSTrainConfig`.
        per_channel: one threshold per channel or one per layer. Default: per channel for
            ``reset="subtract"``, per layer for ``reset="zero"`` (whose plain NIR ``IF`` nodes
            are read by consumers that need one threshold per layer).
        reset: ``"subtract"`` (default: reset by subtraction, ``v[0] = theta/2``, the exact QCFS
            equivalent) or ``"zero"`` (hard reset, ``v[0] = 0``, spikingjelly's
            ``IFNode(v_reset=0.)``, for NIR consumers and chips whose neurons reset to zero).
        bias_calibration: after IF replacement, match each layer's mean output to the
            QCFS-ANN on the calibration batches (:func:`snnconv.calibration.calibrate_bias`).
        bias_calibration_T: the calibration's horizon. ``None`` (default) with subtractive
            reset: the membrane calibration at ``2 * T`` steps (each channel's initial membrane
            absorbs the error, the bias what the membrane's range cannot); one integer: the bias
            alone for that many steps (the default for ``reset="zero"``: ``T``); two horizons
            ``(T1, T2)``: bias and initial membrane per channel fitted exactly at both.
        threshold_calibration: fit each layer's threshold to the QCFS-ANN before the bias
            calibration (:func:`snnconv.calibration.calibrate_thresholds`). Default: on for
            ``reset="zero"`` only.
        weight_calibration: with bias calibration, refit the weights of every layer that reads
            spikes to the QCFS-ANN (ridge least squares). Default: with the membrane
            calibration.
        reconstruction_steps: optimiser steps of the layer-wise reconstruction after the
            calibration (:func:`snnconv.calibration.reconstruct`: every IF layer's spike rate
            over T steps fitted by SGD to the QCFS-ANN's site, on the calibration batches; no
            label is read). ``None`` (default): :data:`RECONSTRUCT_STEPS` where neither QCFS
            training ran nor fine-tuning follows and ``T <= 8`` (subtractive reset, bias
            calibration on); 0 otherwise.
        finetune_epochs: epochs of BPTT fine-tuning, each at most :data:`FINETUNE_MAX_STEPS`
            optimiser steps; with an unlabelled loader the targets are ``model``'s outputs
            alone (:data:`LABEL_FREE_DISTILL`). ``None`` (default): where the loader has two
            batches or more and ``T <= 8`` (:data:`FINETUNE_UP_TO_T`),
            the epochs that reach :data:`FINETUNE_MIN_STEPS` steps (1 to
            :data:`FINETUNE_MAX_EPOCHS`); 0 otherwise.
        finetune_config: a :class:`FinetuneConfig`; with ``distill > 0`` the original
            ``model`` is the teacher. Without one, :func:`finetune_recipe`.
        eval_T: extra T values at which to record SNN accuracy (with ``eval_loader``).
        seed: seeds Python, numpy and torch before any stage.
        device: where the stages run.
        progress: progress bars (False silences them).
        on_collapse: ``"raise"`` (default) or ``"warn"``. After every stage, per-layer activity
            on the first two calibration batches goes into that stage's ``meta`` record
            (:mod:`snnconv.health`). A QCFS site left silent or saturated, or a network at
            chance while the ANN is not, raises :class:`ConversionError` naming the layers.
            Silent SNN layers alone warn: fine-tuning can bring them back.

    Before QCFS training, the reconstruction or fine-tuning, one step of each is timed and the
    plan (stages, steps, the estimated time on this device, what would make it cheaper) is
    logged and printed with ``progress`` (``meta.plan``; :mod:`snnconv.plan`). A default budget
    (``None`` above) whose estimate passes its time budget (:data:`snnconv.plan.TIME_BUDGETS`)
    is cut to fit, and the plan says so; a value given is kept. Every stage sizes its work
    from the free memory (:mod:`snnconv.memory`; ``SNNCONV_MEMORY`` caps it).

    The measurements behind each default are in benchmarks/README.md ("Defaults").

    Returns:
        ``(snn, meta)``: the :class:`SpikingNetwork` and a :class:`ConversionMeta`.

    Raises:
        ConfigError: a setting out of range or contradicting another (named, with the bound).
        DataError, UnsupportedModelError, UnsupportedLayerError, FoldError, ConversionError.
    """
    from .finetune import finetune

    if config is not None and not isinstance(config, ConvertConfig):
        raise ConfigError(f"config must be a ConvertConfig, got {type(config).__name__}")
    if config is not None and config.membrane_calibration is not None and settings:
        raise ConfigError("a resolved ConvertConfig has its dependent defaults filled in for its own "
                          f"settings; change the config you resolved it from instead of passing "
                          f"{', '.join(sorted(settings))} beside it")
    cfg = ConvertConfig.from_options({**(config.options() if config else {}), **settings}).resolved()
    _check_loaders(loader, eval_loader)
    # a loader with its own generator is left as found: the same call gives the same network
    with generators_kept(loader, eval_loader):
        seed_everything(cfg.seed)
        device = torch.device(cfg.device)
        record = cfg.settings()
        calib = draw_batches(loader, cfg.calib_batches)
        if not calib:
            raise DataError("the conversion loader is empty: it yielded no batch. Pass a loader with "
                            "at least one batch.")
        x0, y0 = calib[0]
        finetune_config = cfg.finetune_config
        defaults = {"finetune": cfg.finetune_epochs is None and finetune_config is None,
                    "qcfs": cfg.qcfs_epochs is None and cfg.qcfs_train is None,
                    "reconstruction": cfg.reconstruction_steps is None}
        if defaults["finetune"]:
            epochs, why = _finetune_default(cfg, y0 is not None, loader)
            cfg = cfg.replace(finetune_epochs=epochs)
            record.update(finetune_epochs=epochs, finetune_default=why)
        if finetune_config is None and cfg.finetune_epochs:
            # no labels: the ANN's outputs are the only targets (LABEL_FREE_DISTILL)
            unlabelled = {} if y0 is not None else {"distill": LABEL_FREE_DISTILL}
            finetune_config = finetune_recipe(cfg.T, loader, epochs=cfg.finetune_epochs, seed=cfg.seed,
                                              max_steps=FINETUNE_MAX_STEPS, reset=cfg.reset, **unlabelled)
        if finetune_config is not None:
            record["finetune"] = vars(finetune_config).copy()
        meta = ConversionMeta(settings=record, seed=cfg.seed)
        bias_batches = calib[:cfg.bias_batches]

        with _stage(meta, "prepare") as rec:
            _check_weights(model)
            gm = prepare(model)
            gm.to(device)
            _check_batch(gm, x0, y0, device)
            rec.changes = {"model": type(model).__name__, "input_shape": list(x0.shape),
                           "parameters": sum(p.numel() for p in gm.parameters()),
                           "constructs": rewrite_constructs(gm, (x0.to(device),), maxpool=cfg.maxpool)}
            if cfg.maxpool == "auto":  # the prefix's max-pooling is kept; every later one averages
                cfg = cfg.replace(maxpool="avg")
            check_activations(gm, cfg.maxpool, stage="prepare")  # every refusal at once, early
            health = _Health(calib[:2], device, cfg.on_collapse)
            health.finetune_follows = finetune_config is not None and finetune_config.epochs > 0
        if eval_loader is not None:
            meta.accuracy["ann"] = evaluate(gm, eval_loader, device)
        qcfs_train = _qcfs_training(cfg, gm, health, loader)
        record["qcfs_epochs"] = qcfs_train.epochs if qcfs_train is not None else 0
        if qcfs_train is not None:
            record["qcfs_train"] = vars(qcfs_train).copy()
        if cfg.reconstruction_steps is None:
            steps, why = _reconstruction_default(
                cfg, finetune_config is not None and finetune_config.epochs > 0,
                qcfs_train is not None and qcfs_train.epochs > 0)
            cfg = cfg.replace(reconstruction_steps=steps)
            record.update(reconstruction_steps=steps, reconstruction_default=why)
        record["budget"] = planned_work(loader, qcfs_train, finetune_config)
        record["budget"]["reconstruction_steps"] = cfg.reconstruction_steps
        if qcfs_train is not None and qcfs_train.epochs and cfg.membrane_calibration:
            # trained at L levels: calibrate against that function, over L steps
            cfg = cfg.replace(bias_calibration_T=cfg.L)
            record["bias_calibration_T"] = cfg.L

        with _stage(meta, "fold") as rec:
            pairs = fold_graph(gm, (x0.to(device),))
            assert_no_batchnorm(gm, stage="fold")
            rec.changes = {"folded": [p.to_dict() for p in pairs],
                           "max_abs_diff": max((p.max_abs_diff or 0.0 for p in pairs), default=0.0)}
            health.check(rec, gm, "fold", what="the (folded) ANN")
        if eval_loader is not None:
            meta.accuracy["folded"] = evaluate(gm, eval_loader, device)
        if cfg.reconstruction_steps or record["budget"]["qcfs_steps"] != 0 or health.finetune_follows:
            qcfs_train, finetune_config, cfg = _plan(meta, gm, calib, cfg, qcfs_train, finetune_config,
                                                     defaults, device, loader)

        with _stage(meta, "qcfs") as rec:
            # the full loader only where QCFS training reads it; calibration reads the drawn batches
            qgm = calibrate_qcfs(gm, loader if qcfs_train is not None else calib, L=cfg.L,
                                 percentile=cfg.percentile, per_channel=cfg.per_channel,
                                 num_batches=len(calib), maxpool=cfg.maxpool, train=qcfs_train,
                                 device=device, progress=cfg.progress,
                                 teacher=model if qcfs_train is not None and qcfs_train.distill > 0 else None)
            assert_no_batchnorm(qgm, stage="qcfs")
            rec.changes = dict(qgm.meta["qcfs"], ceil_pools=rewrite_ceil_pools(qgm, (x0.to(device),)))
            qcfs_source = {name: name[len("qcfs_"):] for name in qgm.meta["qcfs"]["sites"]
                           if name.startswith("qcfs_")}
            pooled = qgm.meta["qcfs"].get("maxpool_replaced")
            hint = (f"max-pooling ({', '.join(pooled)}) was replaced by average pooling, a different "
                    "function: retrain with it, or pass qcfs_epochs >= 1 to adapt the weights; "
                    ) if pooled else ""
            health.check(rec, qgm, "qcfs", what="the QCFS-ANN", source=qcfs_source, hint=hint)
        if eval_loader is not None:
            meta.accuracy["qcfs"] = evaluate(qgm, eval_loader, device)

        with _stage(meta, "spiking") as rec:
            snn = to_spiking(qgm, T=cfg.T, reset=cfg.reset)
            fixed_T = None if cfg.horizons else cfg.bias_calibration_T
            if cfg.threshold_calibration:
                snn = calibrate_thresholds(snn, qgm, bias_batches,
                                           T=cfg.T if cfg.horizons or cfg.membrane_calibration else fixed_T,
                                           num_batches=len(bias_batches))
            if cfg.bias_calibration:
                snn = calibrate_bias(snn, qgm, bias_batches, T=fixed_T, horizons=cfg.horizons,
                                     membrane=cfg.membrane_calibration, weights=cfg.weight_calibration,
                                     num_batches=len(bias_batches))
            if cfg.reconstruction_steps:
                horizon = max(cfg.horizons) if cfg.horizons else cfg.bias_calibration_T
                snn, _ = reconstruct(snn, qgm, calib, steps=cfg.reconstruction_steps,
                                     levels=horizon if cfg.bias_calibration else None,
                                     num_batches=len(calib), seed=cfg.seed, progress=cfg.progress)
            snn.meta["input_shape"] = list(x0.shape[1:])  # batch-free; export_nir's default
            snn.to(device)
            assert_no_batchnorm(snn, stage="spiking")
            rec.changes = dict(snn.meta)
            if_source = {n: qcfs_source.get(r.get("source"), r.get("source"))
                         for n, r in snn.meta["neurons"].items()}
            health.check(rec, snn, "spiking", what=f"the SNN at T={cfg.T}", source=if_source)

        if finetune_config is not None and finetune_config.epochs > 0:
            with _stage(meta, "finetune") as rec:
                # distillation learns from the caller's ANN (finetune() works on its own copy)
                teacher = model if finetune_config.distill > 0 else None
                snn, history = finetune(snn, loader, config=finetune_config, teacher=teacher,
                                        device=device, progress=cfg.progress)
                assert_no_batchnorm(snn, stage="finetune")
                rec.changes = {"history": history, "steps": sum(h.get("steps", 0) for h in history)}
                health.check(rec, snn, "finetune", what=f"the fine-tuned SNN at T={cfg.T}",
                             source=if_source)

        if eval_loader is not None:
            Ts = sorted(set(cfg.eval_T) | {cfg.T})
            meta.accuracy["snn"] = {str(t): a for t, a in
                                    accuracy_by_T(snn, eval_loader, Ts, device).items()}
            record["eval_images"] = images_in(eval_loader)
        record_run(meta)
        say_beyond_ann(meta, cfg.progress)
        return snn, meta
