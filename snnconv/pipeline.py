"""convert(): the stages in their order, over a plan decided before the work.

:data:`STAGES` is the one ordered table: prepare -> fold -> qcfs -> spiking [-> finetune]. Each
:class:`Stage` does its work on the conversion's state (:class:`_Run`) and returns what its
record in ``meta.stages`` keeps; the template in :func:`convert` then guards the network it names
(no BatchNorm, :func:`snnconv.guards.assert_no_batchnorm`) and checks its health
(:class:`_Health`). Every default that depends on the data or the graph is decided once, after
the model is traced, by :func:`snnconv.defaults.plan_conversion`; the time plan
(:func:`snnconv.plan.make_plan`) may then cut a default budget.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, cast

import numpy as np
import torch
import torch.nn as nn

from snnconv.activation import check_activations
from snnconv.analysis.health import accuracy_of, activity, chance_level, collapse_report, dead_layers
from snnconv.analysis.metrics import accuracy_by_T, evaluate, kl_to
from snnconv.analysis.summary import images_in, say_beyond_ann
from snnconv.calibration import calibrate_bias, calibrate_thresholds, reconstruct
from snnconv.calibration.noise import residual_noise
from snnconv.calibration.reference import unquantised
from snnconv.config import ConvertConfig
from snnconv.constructs.pools import rewrite_ceil_pools
from snnconv.data import check_labels, generators_kept
from snnconv.defaults import (
    ConversionPlan,
    GraphFacts,
    LoaderFacts,
    default_finetune_epochs,
    finetune_recipe,
    later_maxpool,
    plan_conversion,
)
from snnconv.errors import ConfigError, ConversionError, DataError, ResourceError, UnsupportedModelError
from snnconv.graph import prepare
from snnconv.guards import assert_no_batchnorm
from snnconv.meta import ConversionMeta, StageRecord
from snnconv.plan import log_plan, make_plan, planned_work, record_run
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.nir_io import no_nir_form
from snnconv.stages.fold import fold_graph
from snnconv.stages.prepare import rewrite_constructs
from snnconv.stages.qcfs import calibrate_qcfs
from snnconv.stages.spiking import to_spiking
from snnconv.vocabulary import StageName

__all__ = ["convert", "ConvertConfig", "STAGES", "Stage", "seed_everything", "draw_batches", "finetune_recipe",
           "default_finetune_epochs"]


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
        self.settings: ConvertConfig | None = None  # the plan's, once decided
        self.qcfs_trained = False

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
        if stage == StageName.FOLD:
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
        fatal = stage == StageName.QCFS or any(f.startswith("at chance") for f in findings)
        if stage == StageName.SPIKING and self.finetune_follows:
            fatal = False  # fine-tuning comes next; its result is checked
        n = sum(len(x) for x in self.x)
        anyway = " pass on_collapse='warn' to get the network anyway." if fatal and self.on_collapse == "raise" else ""
        message = (f"after stage '{stage}', {what} collapsed on {n} calibration samples: "
                   + "; ".join(findings) + f". What to do: {hint}try "
                   + collapse_advice(self.settings, self.qcfs_trained) + "." + anyway)
        if fatal and self.on_collapse == "raise":
            raise ConversionError(message, layers=list(findings))
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def collapse_advice(cfg: ConvertConfig | None, qcfs_trained: bool) -> str:
    """What to change after a collapse, naming only settings that differ from ``cfg`` (the
    settings in use): per-channel thresholds, bias calibration, a larger T, and where QCFS
    training ran, fewer epochs of it or a lower learning rate."""
    tips = []
    if cfg is None or not cfg.per_channel:
        tips.append("per_channel=True")
    tips.append("a larger T" + (f" than {cfg.T}" if cfg is not None else ""))
    if cfg is None or not cfg.bias_calibration:
        tips.append("bias_calibration=True")
    if cfg is not None and cfg.reset == "zero":
        tips.append("reset='subtract' (no charge is lost at a spike)")
    if qcfs_trained:
        tips.append("fewer QCFS training epochs or a lower learning rate (qcfs_epochs, qcfs_train)")
    return ", ".join(tips[:-1]) + (", or " if len(tips) > 1 else "") + tips[-1]


#: At most this many images of the validation split choose between a step's network and the
#: one it started from (:class:`_Judge`).
JUDGE_IMAGES = 1024


class _Judge:
    """Keeps a calibration's or fine-tuning's network only where it does better than the network
    it started from, beyond the noise of the images that judge, at the conversion's T, on
    held-out images of the loader (the split that fine-tuning validates on, at most as many
    images as the calibration batches hold, at most :data:`JUDGE_IMAGES`).

    An image is right where the network's decision is its label (without labels: the ANN's
    decision). Of the images the two networks decide differently, a calibration must win at
    least as many as it loses (a tie keeps it: it fitted no label and helps on average, the
    Defaults rows). Fine-tuning chose its best epoch on these same images, which favours it, so
    it must win by ``wins - losses >= max(1, sqrt(wins + losses))`` (one standard deviation of
    that difference where the two were equally good). No step of the default conversion makes
    its network worse than the simpler path without it on data the step did not fit."""

    def __init__(self, batches: list, ann: nn.Module, device: torch.device):
        self.batches = [(x.to(device), y) for x, y in batches]
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            self.ann = [ann(x) for x, _ in self.batches]
        self.labelled = all(y is not None for _, y in self.batches)
        self.record: dict[str, dict[str, Any]] = {}
        self._last: tuple[Any, tuple[torch.Tensor, float]] | None = None  # the network kept last, its score

    @classmethod
    def of(cls, loader: Any, calib: list, ann: nn.Module, device: torch.device, val_fraction: float,
           seed: int) -> "_Judge":
        """The judge of ``loader``'s held-out images: the validation split ``(val_fraction,
        seed)`` that fine-tuning holds out of its training (where there is none, or the loader
        is too small to split, the calibration batches)."""
        from snnconv.data import split_loader

        images = min(JUDGE_IMAGES, sum(len(x) for x, _ in calib))
        batches: list = []
        try:
            if isinstance(loader, (list, tuple)) or hasattr(getattr(loader, "dataset", None), "__len__"):
                # the split that fine-tuning validates on (held out of its training)
                val = split_loader(loader, val_fraction, seed=seed)[1] if val_fraction > 0 else None
                batches = draw_batches(val, 10**9, images=images) if val is not None else []
            else:  # a stream: the batches after the calibration's, never the whole stream
                batches = draw_batches(loader, 10**9, images=sum(len(x) for x, _ in calib) + images)[len(calib):]
        except DataError:
            batches = []
        return cls(batches or calib, ann, device)

    def score(self, net: nn.Module, horizons: tuple[int, ...] | None = None) -> tuple[torch.Tensor, float]:
        """Per image whether ``net`` decides right (a bool tensor ``[images, 1]``; with
        ``horizons``, ``[images, horizons]``: its readout averaged over the first h steps of one
        run), and its mean KL divergence to the ANN's outputs (at its T)."""
        right, kl, n = [], 0.0, 0
        was = net.training
        net.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for (x, y), ref in zip(self.batches, self.ann):
                    out = net(x)
                    target = y.to(out.device) if self.labelled else ref.argmax(1)
                    if horizons:
                        steps = cast(SpikingNetwork, net).run(x, T=max(horizons)).cumsum(0)  # [H, B, classes]
                        right.append(torch.stack([(steps[h - 1].argmax(1) == target).cpu() for h in horizons], 1))
                    else:
                        right.append((out.argmax(1) == target).cpu().unsqueeze(1))
                    n += len(x)
                    kl += float(kl_to(ref, out).sum())
        finally:
            net.train(was)
        return torch.cat(right), kl / max(1, n)

    def keep(self, step: str, before: SpikingNetwork, after: SpikingNetwork, *,
             selected_here: bool = False, horizons: tuple[int, ...] | None = None,
             at: int | None = None) -> SpikingNetwork:
        """``after`` where it does at least as well as ``before`` (recorded under ``step``);
        ``selected_here``: ``after`` was chosen on these images, and must beat ``before``
        beyond their noise; ``horizons``: judged on the readouts after each of these steps
        (every image at every horizon), not at T alone; ``at`` (one of them): and not worse
        after that many steps beyond the noise there (``wins - losses >= -sqrt(wins + losses)``
        at that step: a network as good there as ``before`` is kept whichever way its few
        differing images fall)."""
        last = self._last is not None and self._last[0] is before and not horizons
        a = self._last[1] if last else self.score(before, horizons)  # type: ignore[index]
        b = self.score(after, horizons)
        wins, losses = int((b[0] & ~a[0]).sum()), int((a[0] & ~b[0]).sum())
        kept = wins - losses >= (max(1.0, math.sqrt(wins + losses)) if selected_here else 0)
        extra: dict[str, Any] = {"horizons": list(horizons)} if horizons else {}
        if horizons and at is not None:
            j = horizons.index(at)
            at_wins, at_losses = int((b[0][:, j] & ~a[0][:, j]).sum()), int((a[0][:, j] & ~b[0][:, j]).sum())
            kept = kept and at_wins - at_losses >= -math.sqrt(at_wins + at_losses)
            extra["at"] = {"steps": at, "before": 100.0 * float(a[0][:, j].double().mean()),
                           "after": 100.0 * float(b[0][:, j].double().mean()), "wins": at_wins, "losses": at_losses}
        self._last = None if horizons else (after, b) if kept else (before, a)
        self.record[step] = {"before": 100.0 * float(a[0].double().mean()),
                             "after": 100.0 * float(b[0].double().mean()), "wins": wins, "losses": losses,
                             "kl_before": a[1], "kl_after": b[1], "kept": kept, "images": len(a[0]), **extra,
                             "measure": "accuracy" if self.labelled else "agreement with the ANN"}
        return after if kept else before


def draw_batches(loader: Iterable, n: int, images: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The first ``n`` batches of ``loader`` (and no more once they hold ``images`` inputs) as
    ``(x, y)`` pairs (``y`` None when unlabelled), drawn without moving the global RNG: the
    calibration batches every stage shares."""
    from snnconv.data import SameShape, split_batch

    batches: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    same = SameShape("the conversion loader")
    with torch.random.fork_rng(devices=[]):
        for batch in loader:
            if len(batches) >= n or (images is not None and sum(len(b[0]) for b in batches) >= images):
                break
            x, y = split_batch(batch, where="the conversion loader")
            batches.append((same(x, len(batches)), y))
    return batches


def _check_loaders(loader: Any, eval_loader: Any) -> None:
    for name, data in (("loader", loader), ("eval_loader", eval_loader)):
        if isinstance(data, collections.abc.Iterator):
            raise DataError(
                f"{name} is a one-shot iterator ({type(data).__name__}); convert() reads it more "
                "than once (checks, calibration, training, evaluation). Pass a DataLoader or a "
                "list of batches instead.")


@dataclass
class _Run:
    """What convert()'s stages hand on: the call's inputs, the plan (from the end of "prepare"),
    and the network each stage leaves."""

    model: nn.Module
    loader: Any
    eval_loader: Any
    calib: list
    device: torch.device
    meta: ConversionMeta
    config: ConvertConfig  # the call's settings, resolved; the plan's config adds the data's defaults
    plan: ConversionPlan | None = None
    health: Any = None  # _Health, from "prepare"
    gm: Any = None  # the traced ANN ("prepare"), BatchNorm folded ("fold")
    qgm: Any = None  # the QCFS-ANN ("qcfs")
    snn: Any = None  # the spiking network ("spiking", "finetune")
    qcfs_source: dict = field(default_factory=dict)  # QCFS site -> the ANN's ReLU node
    if_source: dict = field(default_factory=dict)  # IF neuron -> the ANN's ReLU node
    judge: Any = None  # _Judge, from "spiking"

    @property
    def settings(self) -> ConvertConfig:
        return self.plan.config if self.plan is not None else self.config

    def accuracy(self, key: str, network: nn.Module) -> None:
        """The accuracy of ``network`` on the eval loader into ``meta.accuracy[key]``, if there is one."""
        if self.eval_loader is not None:
            self.meta.accuracy[key] = evaluate(network, self.eval_loader, self.device)


#: What the template checks after a stage: the network, how the health check names it, the
#: ANN's ReLU node behind each site, and a hint for a collapse.
Checked = tuple[nn.Module, str, "dict[str, str] | None", str]


@dataclass(frozen=True)
class Stage:
    """One stage of :func:`convert`: ``run`` does its work and returns what its record keeps;
    ``checked`` (None: nothing to check yet) names the network that the template then guards and
    checks; ``then`` runs after the stage's record is closed (evaluation, planning); ``runs``
    says whether the plan has the stage."""

    name: str
    run: Callable[[_Run], dict]
    checked: Callable[[_Run], Checked] | None = None
    then: Callable[[_Run], None] | None = None
    runs: Callable[[_Run], bool] = lambda state: True


def _prepare(s: _Run) -> dict:
    """Trace the model, check its weights and the first batch, rewrite the constructs."""
    x0, y0 = s.calib[0]
    _check_weights(s.model)
    s.gm = prepare(s.model)
    s.gm.to(s.device)
    _check_batch(s.gm, x0, y0, s.device)
    changes = {"model": type(s.model).__name__, "input_shape": list(x0.shape),
               "parameters": sum(p.numel() for p in s.gm.parameters()),
               "constructs": rewrite_constructs(s.gm, (x0.to(s.device),), maxpool=s.config.maxpool)}
    check_activations(s.gm, later_maxpool(s.config.maxpool), stage="prepare")  # every refusal at once, early
    changes["no_nir_form"] = no_nir_form(s.gm)  # what export_nir would refuse, known before the work
    s.health = _Health(s.calib[:2], s.device, s.config.on_collapse)
    return changes


def _plan_defaults(s: _Run) -> None:
    """The ANN's accuracy, then every default decided from the traced model and the loader."""
    s.accuracy("ann", s.gm)
    s.plan = plan_conversion(s.config, GraphFacts.of(s.gm), LoaderFacts.of(s.loader, s.calib[0][1] is not None))
    _record_plan(s.meta.settings, s.plan, s.loader)
    s.health.finetune_follows = s.plan.finetunes
    s.health.settings, s.health.qcfs_trained = s.plan.config, s.plan.qcfs_trains


def _fold(s: _Run) -> dict:
    pairs = fold_graph(s.gm, (s.calib[0][0].to(s.device),))
    return {"folded": [p.to_dict() for p in pairs],
            "max_abs_diff": max((p.max_abs_diff or 0.0 for p in pairs), default=0.0)}


def _plan_time(s: _Run) -> None:
    """The folded ANN's accuracy, then the time plan of the training-style stages, if any runs."""
    s.accuracy("folded", s.gm)
    assert s.plan is not None
    if s.plan.config.reconstruction_steps or s.meta.settings["budget"]["qcfs_steps"] != 0 or s.plan.finetunes:
        s.plan = _time_plan(s.meta, s.gm, s.calib, s.plan, s.device, s.loader)


def _qcfs(s: _Run) -> dict:
    """QCFS thresholds (and QCFS training where planned) on the folded ANN. A default hard-reset
    rate whose training did not improve on its calibration falls back to plain QCFS (the
    untrained staircase of a deep network is a poor reference)."""
    assert s.plan is not None
    cfg, train = s.plan.config, s.plan.qcfs_train
    assert cfg.L is not None and cfg.per_channel is not None  # (resolved)
    # the full loader only where QCFS training reads it; calibration reads the drawn batches
    s.qgm = _calibrate_qcfs(s, train, cfg.T if cfg.hard_rate else None)
    fallback = None
    if cfg.hard_rate and "hard_rate_default" in s.plan.reasons and s.qgm.meta["qcfs"].get("best_epoch") == 0:
        import warnings

        fallback = ("the hard-reset rate's training did not beat its calibration on the validation split: "
                    "converted with plain QCFS instead (as hard_rate=False)")
        warnings.warn(fallback, RuntimeWarning, stacklevel=3)
        # the training stays where the caller asked for it or max-pooling became average pooling
        train = train if s.plan.defaults.get("qcfs") is False or s.qgm.meta["qcfs"]["maxpool_replaced"] else None
        s.qgm = _calibrate_qcfs(s, train, None)
    changes = dict(s.qgm.meta["qcfs"], ceil_pools=rewrite_ceil_pools(s.qgm, (s.calib[0][0].to(s.device),)))
    if fallback:
        changes["hard_rate_fallback"] = fallback
    s.qcfs_source = {name: name[len("qcfs_"):] for name in s.qgm.meta["qcfs"]["sites"] if name.startswith("qcfs_")}
    return changes


def _calibrate_qcfs(s: _Run, train: Any, hard_T: int | None) -> Any:
    cfg = s.settings
    assert cfg.L is not None and cfg.per_channel is not None  # (resolved)
    return calibrate_qcfs(s.gm, s.loader if train is not None else s.calib, L=cfg.L,
                          percentile=cfg.percentile, per_channel=cfg.per_channel,
                          num_batches=len(s.calib), maxpool=cfg.maxpool, train=train,
                          device=s.device, progress=cfg.progress,
                          teacher=s.model if train is not None and train.distill > 0 else None,
                          noise_model=(functools.partial(residual_noise, T=cfg.T, reset=cfg.reset)
                                       if train is not None and train.epochs > 0 and train.noise > 0 else None),
                          hard_T=hard_T)


def _qcfs_checked(s: _Run) -> Checked:
    pooled = s.qgm.meta["qcfs"].get("maxpool_replaced")
    hint = (f"max-pooling ({', '.join(pooled)}) was replaced by average pooling, a different "
            "function: retrain with it, or pass qcfs_epochs >= 1 to adapt the weights; ") if pooled else ""
    return s.qgm, "the QCFS-ANN", s.qcfs_source, hint


def _spiking(s: _Run) -> dict:
    """IF neurons in place of QCFS, then the calibrations and the reconstruction the plan has."""
    cfg = s.settings
    assert cfg.membrane_calibration is not None and cfg.weight_calibration is not None  # (resolved)
    bias_batches = s.calib[:cfg.bias_batches]
    snn = to_spiking(s.qgm, T=cfg.T, reset=cfg.reset, burst=cfg.burst)
    from snnconv.stages.finetune import FinetuneConfig

    held = s.plan.finetune if s.plan is not None and s.plan.finetune is not None else FinetuneConfig(seed=cfg.seed)
    s.judge = judge = _Judge.of(s.loader, s.calib, s.gm, s.device, held.val_fraction, held.seed)
    # one horizon (an int, or None: T), or two (cfg.horizons)
    fixed_T = None if cfg.horizons else cast(int | None, cfg.bias_calibration_T)
    if cfg.threshold_calibration:
        snn = judge.keep("threshold_calibration", snn, calibrate_thresholds(
            snn, s.qgm, bias_batches, T=cfg.T if cfg.horizons or cfg.membrane_calibration else fixed_T,
            num_batches=len(bias_batches)))
    if cfg.bias_calibration:
        reference = s.qgm if cfg.calibration_reference == "qcfs" else unquantised(s.qgm)
        calibrated = calibrate_bias(snn, reference, bias_batches, T=fixed_T, horizons=cfg.horizons,
                                    membrane=cfg.membrane_calibration, weights=cfg.weight_calibration,
                                    num_batches=len(bias_batches))
        snn = judge.keep("bias_calibration", snn, calibrated)
        # what the calibration did, kept or not
        snn.meta["bias_calibration"] = dict(calibrated.meta["bias_calibration"],
                                            kept=judge.record["bias_calibration"]["kept"])
    if cfg.reconstruction_steps:
        horizon = max(cfg.horizons) if cfg.horizons else fixed_T
        bias_kept = judge.record.get("bias_calibration", {}).get("kept", False)
        rebuilt, done = reconstruct(snn, s.qgm, s.calib, steps=cfg.reconstruction_steps,
                                    levels=horizon * cfg.burst if bias_kept and horizon else None,
                                    num_batches=len(s.calib), seed=cfg.seed, progress=cfg.progress)
        snn = judge.keep("reconstruction", snn, rebuilt)
        snn.meta["reconstruction"] = dict(done, kept=judge.record["reconstruction"]["kept"])
    snn.meta["calibrated_T"] = cfg.T
    snn.meta["input_shape"] = list(s.calib[0][0].shape[1:])  # batch-free; export_nir's default
    s.snn = snn.to(s.device)
    s.if_source = {n: s.qcfs_source.get(r.get("source"), r.get("source")) for n, r in snn.meta["neurons"].items()}
    return dict(snn.meta, kept=dict(judge.record))


def _finetune(s: _Run) -> dict:
    """BPTT fine-tuning, distilled from the caller's ANN where the recipe says (finetune()
    works on its own copy)."""
    from snnconv.stages.finetune import finetune

    assert s.plan is not None and s.plan.finetune is not None
    teacher = s.model if s.plan.finetune.distill > 0 else None
    start = s.snn
    tuned, history = finetune(start, s.loader, config=s.plan.finetune, teacher=teacher,
                              device=s.device, progress=s.settings.progress)
    # readouts for early exit: judged on every readout it trained (where an exit rule reads
    # them); unless the caller asked for early exit, also not worse at T beyond the noise
    horizons = tuple(s.plan.finetune.horizons) if s.plan.anytime else None
    s.snn = s.judge.keep("finetune", start, tuned, selected_here=True, horizons=horizons,
                         at=s.settings.T if horizons and not s.settings.early_exit else None)
    return {"history": history, "steps": sum(h.get("steps", 0) for h in history),
            "kept": s.judge.record["finetune"]}


def _early_exit(s: _Run) -> dict:
    """The exit rule at the default tolerance, calibrated on the judge's held-out images (with
    their labels, else the network's own answers at T) and stored in the network."""
    from snnconv.analysis.early_exit import calibrate_exit
    from snnconv.exit_rule import DEFAULT_TOLERANCE

    rec = calibrate_exit(s.snn, s.judge.batches, T=s.settings.T, tolerance=DEFAULT_TOLERANCE,
                         labels=s.judge.labelled, device=s.device)
    return rec.to_dict()


#: convert()'s stages in their order; each name is its record's in ``meta.stages``.
STAGES: tuple[Stage, ...] = (
    Stage(StageName.PREPARE, _prepare, then=_plan_defaults),
    Stage(StageName.FOLD, _fold, checked=lambda s: (s.gm, "the (folded) ANN", None, ""), then=_plan_time),
    Stage(StageName.QCFS, _qcfs, checked=_qcfs_checked, then=lambda s: s.accuracy("qcfs", s.qgm)),
    Stage(StageName.SPIKING, _spiking, checked=lambda s: (s.snn, f"the SNN at T={s.settings.T}", s.if_source, "")),
    Stage(StageName.FINETUNE, _finetune, runs=lambda s: s.plan is not None and s.plan.finetunes,
          checked=lambda s: (s.snn, f"the fine-tuned SNN at T={s.settings.T}", s.if_source, "")),
    Stage(StageName.EARLY_EXIT, _early_exit, runs=lambda s: s.settings.early_exit,
          checked=lambda s: (s.snn, f"the SNN at T={s.settings.T} with its exit rule", s.if_source, "")),
)


def _record_plan(record: dict, plan: ConversionPlan, loader: Any) -> None:
    """The plan's decisions into ``meta.settings``."""
    cfg = plan.config
    if "finetune_default" in plan.reasons:
        record.update(finetune_epochs=cfg.finetune_epochs, finetune_default=plan.reasons["finetune_default"])
    if plan.finetune is not None:
        record["finetune"] = vars(plan.finetune).copy()
    record["qcfs_epochs"] = plan.qcfs_train.epochs if plan.qcfs_train is not None else 0
    record["hard_rate"] = bool(cfg.hard_rate)
    if "hard_rate_default" in plan.reasons:
        record["hard_rate_default"] = plan.reasons["hard_rate_default"]
    if plan.qcfs_train is not None:
        record["qcfs_train"] = vars(plan.qcfs_train).copy()
    if "reconstruction_default" in plan.reasons:
        record.update(reconstruction_steps=cfg.reconstruction_steps,
                      reconstruction_default=plan.reasons["reconstruction_default"])
    record["budget"] = planned_work(loader, plan.qcfs_train, plan.finetune)
    record["budget"]["reconstruction_steps"] = cfg.reconstruction_steps
    if plan.qcfs_trains and cfg.membrane_calibration:
        record["bias_calibration_T"] = cfg.L


def _time_plan(meta: ConversionMeta, gm: nn.Module, calib: list, plan: ConversionPlan, device: torch.device,
               loader: Any) -> ConversionPlan:
    """Measure and log the time plan of the training-style stages (:func:`snnconv.plan.make_plan`)
    into ``meta.plan``; a default budget it cut is recorded as it will run."""
    record, finetune = meta.settings, plan.finetune
    try:
        val = int(len(loader.dataset) * finetune.val_fraction) if finetune is not None else None
    except (AttributeError, TypeError):
        val = None
    timing, qcfs_train, finetune, steps = make_plan(
        gm, calib, plan.config, qcfs_train=plan.qcfs_train, finetune_config=finetune, budget=record["budget"],
        defaults=plan.defaults, device=device, val_images=val)
    meta.plan = timing.to_dict()
    log_plan(timing, plan.config.progress)
    if any(s.cut_from is not None for s in timing.stages):
        plan = plan.cut(qcfs_train, finetune, steps)
        if qcfs_train is not None:
            record["qcfs_train"] = vars(qcfs_train).copy()
        if finetune is not None:
            record["finetune"] = vars(finetune).copy()
            record["finetune_epochs"] = finetune.epochs
        record["reconstruction_steps"] = steps
        record["budget"] = dict(planned_work(loader, qcfs_train, finetune), reconstruction_steps=steps)
    return plan


def convert(model: nn.Module, loader: Iterable, config: ConvertConfig | None = None, *,
            eval_loader: Iterable | None = None, **settings: Any) -> tuple[SpikingNetwork, ConversionMeta]:
    """Convert a trained ReLU network into a spiking network of IF neurons.

    Runs the :data:`STAGES` in order: prepare (trace) -> fold BatchNorm -> QCFS calibration (and
    QCFS training where planned) -> IF replacement and calibration -> BPTT fine-tuning, each
    guarded (no BatchNorm) and checked (:class:`_Health`). The caller's ``model`` is never
    changed. By default a target ``T <= 8`` gets whole epochs of fine-tuning up to at least
    :data:`snnconv.defaults.FINETUNE_MIN_STEPS` optimiser steps, distilled from ``model``'s
    outputs alone where the loader has no labels; ``finetune_epochs=0`` converts without
    training, which is also what a loader of one batch or ``T >= 16`` gets
    (:func:`snnconv.defaults.plan_conversion` decides every such default).
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

    Settings (keyword arguments, or fields of :class:`ConvertConfig`, where each is
    documented): ``T``, ``L``, ``percentile``, ``calib_batches``, ``maxpool``, ``qcfs_epochs``,
    ``qcfs_train``, ``per_channel``, ``reset``, ``bias_calibration``, ``bias_calibration_T``,
    ``threshold_calibration``, ``weight_calibration``, ``membrane_calibration``,
    ``reconstruction_steps``, ``finetune_epochs``, ``finetune_config``, ``eval_T``, ``seed``,
    ``device``, ``progress``, ``on_collapse``, ``burst``.

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
    if config is not None and not isinstance(config, ConvertConfig):
        raise ConfigError(f"config must be a ConvertConfig, got {type(config).__name__}")
    if config is not None and config.is_resolved and settings:
        raise ConfigError("a resolved ConvertConfig has its dependent defaults filled in for its own "
                          f"settings; change the config you resolved it from instead of passing "
                          f"{', '.join(sorted(settings))} beside it")
    cfg = ConvertConfig.from_options({**(config.options() if config else {}), **settings}).resolved()
    _check_loaders(loader, eval_loader)
    # a loader with its own generator is left as found: the same call gives the same network
    with generators_kept(loader, eval_loader):
        seed_everything(cfg.seed)
        calib = draw_batches(loader, cfg.calib_batches)
        if not calib:
            raise DataError("the conversion loader is empty: it yielded no batch. Pass a loader with "
                            "at least one batch.")
        meta = ConversionMeta(settings=cfg.settings(), seed=cfg.seed)
        state = _Run(model, loader, eval_loader, calib, torch.device(cfg.device), meta, cfg)
        for stage in STAGES:
            if not stage.runs(state):
                continue
            with _stage(meta, stage.name) as rec:
                rec.changes = stage.run(state)
                if stage.checked is not None:
                    network, what, source, hint = stage.checked(state)
                    assert_no_batchnorm(network, stage=stage.name)
                    state.health.check(rec, network, stage.name, what=what, source=source, hint=hint)
            if stage.then is not None:
                stage.then(state)
        if eval_loader is not None:
            Ts = sorted(set(state.settings.eval_T) | {state.settings.T})
            by_T = accuracy_by_T(state.snn, eval_loader, Ts, state.device)
            meta.accuracy["snn"] = {str(t): a for t, a in by_T.items()}
            meta.settings["eval_images"] = images_in(eval_loader)
        record_run(meta)
        say_beyond_ann(meta, state.settings.progress)
        return state.snn, meta
