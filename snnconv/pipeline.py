"""convert(): the only place that knows the stage order.

prepare -> fold -> guard -> QCFS -> guard -> IF -> guard [-> BPTT fine-tune -> guard]
"""

from __future__ import annotations

import collections.abc
import contextlib
import math
import numbers
import random
import time
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

from .calibration import calibrate_bias, calibrate_thresholds
from .data import first_batch, generators_kept
from .errors import ConversionError, DataError, UnsupportedModelError
from .constructs import rewrite_constructs
from .fold import fold_graph
from .graph import prepare
from .health import accuracy_of, activity, chance_level, collapse_report, dead_layers
from .guards import assert_no_batchnorm
from .meta import ConversionMeta, StageRecord
from .metrics import accuracy_by_T, evaluate
from .network import SpikingNetwork
from .qcfs import QCFSTrainConfig, calibrate_qcfs, max_pools
from .replace import to_spiking

__all__ = ["convert", "seed_everything"]

#: The fine-tuning recipe of ``convert()`` (the rest as in :class:`FinetuneConfig`): unrolled
#: for ``2 * T`` steps with readouts trained at ``T // 2``, ``T`` and ``2 * T``
#: (:func:`finetune_recipe`). Distillation from the ANN, trained thresholds, ATan alpha 4, lr
#: 2e-3: on the robustness matrix, one epoch at T=4 on four networks, three seeds, mean T=4 gap
#: to the ANN 15.27 -> 8.98 (ResNet-20), 5.92 -> 3.73 (tv_resnet), 36.18 -> 19.87 (MobileNet),
#: 2.92 -> 1.93 (small CNN) against alpha 2 / lr 1e-3 / frozen thresholds / no distillation; the
#: readout at 2T keeps the network at longer T (benchmarks/README.md, "Defaults").
#: The converted network competes as epoch 0 (``keep_start``): fine-tuning never returns a
#: network worse on the validation split than the training-free one.
#: ``FinetuneConfig()`` keeps the conservative defaults: it has no teacher of its own.
#: ``batch_size`` is the largest: see :func:`_finetune_batch`.
CONVERT_FINETUNE = {"alpha": 4.0, "lr": 2e-3, "train_thresholds": True, "distill": 0.5, "batch_size": 64,
                    "keep_start": True}

#: Fine-tuning steps per epoch that convert() keeps by smaller batches on small data sets, and
#: the smallest batch it goes down to (benchmarks/README.md, "Defaults").
_FINETUNE_STEPS, _FINETUNE_MIN_BATCH = 256, 16

#: The default budget of the BPTT stage: one epoch of the loader's training split, at most this
#: many optimiser steps (a large data set is sampled, never run whole by default).
FINETUNE_MAX_STEPS = 2000

#: Target T up to which convert() fine-tunes by default (with a labelled loader). At T >= 16
#: the training-free calibration is within 3 points of the ANN at T=16 and 1 at T=32 on the
#: robustness matrix, and BPTT through 2T steps would cost 4-8x what it costs at T=4.
FINETUNE_UP_TO_T = 8


def finetune_recipe(T: int, loader: Any = None, *, epochs: int = 1, seed: int = 0,
                    max_steps: int | None = FINETUNE_MAX_STEPS, reset: str = "subtract", **changes: Any):
    """The :class:`FinetuneConfig` that ``convert(..., T=T)`` fine-tunes with.

    BPTT through ``2 * T`` steps, readouts trained at ``T // 2``, ``T`` and ``2 * T`` (the
    network answers well from half its steps to twice them), :data:`CONVERT_FINETUNE`, a batch
    from :func:`_finetune_batch` and at most ``max_steps`` optimiser steps per epoch. Hard-reset
    networks (``reset="zero"``) train with the reset detached from the graph: on a digits
    ResNet converted at T=8, one epoch reached 87.3 / 97.6% at T=4 / 8 against 73.7 / 96.7
    with the gradient through the reset, and on Fashion-MNIST the latter diverged
    (benchmarks/README.md, "Defaults"); for subtractive reset detaching cost 1.3 points at T=4.
    ``changes`` override single fields.
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


def _epoch_steps(loader: Any, val_fraction: float, batch: int | None = None) -> int | None:
    """Optimiser steps in one epoch of ``loader``'s training split (in batches of ``batch``,
    else the loader's own); None for a loader without a length."""
    try:
        if batch is not None:
            return max(1, int(len(loader.dataset) * (1.0 - val_fraction)) // batch)
        return max(1, int(len(loader) * (1.0 - val_fraction)))
    except (AttributeError, TypeError):
        return None


def _budget(loader: Any, qcfs_train: QCFSTrainConfig | None, finetune_config: Any) -> dict[str, Any]:
    """The planned work of the training stages in optimiser steps (None: as long as the loader
    runs), and one ANN training epoch over ``loader`` (its length) as the unit to compare with."""
    try:
        ann_epoch = len(loader)
    except TypeError:
        ann_epoch = None
    out: dict[str, Any] = {"ann_epoch_steps": ann_epoch, "qcfs_steps": 0, "finetune_steps": 0}
    if qcfs_train is not None and qcfs_train.epochs:
        per = _epoch_steps(loader, qcfs_train.val_fraction)
        out["qcfs_steps"] = None if per is None else qcfs_train.epochs * per
    if finetune_config is not None and finetune_config.epochs:
        cfg = finetune_config
        per = _epoch_steps(loader, cfg.val_fraction, cfg.batch_size if hasattr(loader, "dataset") else None)
        if cfg.max_steps_per_epoch:
            per = cfg.max_steps_per_epoch if per is None else min(per, cfg.max_steps_per_epoch)
        out["finetune_steps"] = None if per is None else cfg.epochs * per
        out["finetune_T"] = cfg.T
    return out


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _bias_batches(calib_batches: Any) -> int:
    """Batches of bias/membrane calibration: 4, or fewer where the user asked for fewer."""
    return min(4, calib_batches) if isinstance(calib_batches, int) and calib_batches > 0 else 4


#: QCFS training steps of ``convert(qcfs_epochs=None)`` where ``maxpool="avg"`` replaced
#: max-pooling, as whole epochs of the training split (:func:`_maxpool_qcfs_epochs`). On the
#: robustness matrix's VGG (2 and 10 training epochs, three seeds, AMD EPYC; 36 steps per epoch)
#: the worst-seed gap to the ANN at T=16 / 32 after 1 / 3 / 6 / 10 / 16 epochs: 7.65 / 7.85,
#: 5.05 / 5.20, 3.30 / 3.45, 1.85 / 1.65, 1.00 / 0.85 (2 epochs) and 5.80 / 6.20, 2.85 / 2.80,
#: 1.55 / 1.40, 0.80 / 0.65, 1.45 / 1.25 (10 epochs); on the full Fashion-MNIST training set
#: (422 steps per epoch) 2, 4 and 6 epochs gave the same T=16 / 32 accuracy within 0.65 points,
#: two seeds (benchmarks/README.md, "QCFS training where max-pooling became average pooling:
#: steps").
_MAXPOOL_QCFS_STEPS = 576


def _maxpool_qcfs_epochs(loader: Any) -> int:
    """Epochs of :data:`_MAXPOOL_QCFS_STEPS` steps over the training split of ``loader`` (its
    validation split held out), between 1 and 64 (a tiny loader: each epoch is also a
    validation pass); 16 (the matrix's) for a loader without a length."""
    try:
        steps = len(loader) * (1.0 - QCFSTrainConfig.val_fraction)
    except TypeError:
        return 16
    return min(64, max(1, math.ceil(_MAXPOOL_QCFS_STEPS / max(1.0, steps))))


def _qcfs_training(qcfs_epochs: int | None, qcfs_train: QCFSTrainConfig | None, maxpool: str,
                   gm: nn.Module, health: "_Health", seed: int, loader: Any) -> QCFSTrainConfig | None:
    """QCFS training settings; ``qcfs_epochs=None`` (default) trains
    :data:`_MAXPOOL_QCFS_STEPS` steps (:func:`_maxpool_qcfs_epochs`) where ``maxpool="avg"``
    replaces max-pooling (a different function: on the robustness matrix the QCFS-ANN of a
    VGG drops from 82-89% to 45-58% without it and recovers to 82-89% with 16 epochs;
    benchmarks/README.md), none otherwise (on networks without max-pooling one epoch changed
    little or cost accuracy at T >= 16)."""
    import warnings

    if qcfs_train is not None or qcfs_epochs:
        return qcfs_train or QCFSTrainConfig(epochs=qcfs_epochs, seed=seed)
    if qcfs_epochs is None and maxpool == "avg":
        pools = max_pools(gm)
        if pools and health.y:
            return QCFSTrainConfig(epochs=_maxpool_qcfs_epochs(loader), seed=seed)
        if pools:
            warnings.warn(f"max-pooling ({', '.join(pools)}) becomes average pooling, which needs "
                          "QCFS training to adapt the weights, but the loader has no labels: "
                          "calibrating only (expect a large accuracy loss)", stacklevel=3)
    return None


@contextlib.contextmanager
def _stage(meta: ConversionMeta, name: str) -> Iterator[StageRecord]:
    record = StageRecord(name)
    start = time.perf_counter()
    yield record
    record.seconds = time.perf_counter() - start
    meta.stages.append(record)


def _check_weights(model: nn.Module) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not torch.isfinite(t).all():
            n = (~torch.isfinite(t)).sum().item()
            raise UnsupportedModelError(
                f"'{name}' holds {n} NaN/inf value(s); a converted network would propagate them. "
                "Fix the training run (or the checkpoint) that produced these weights.")


def _check_batch(gm: nn.Module, x: torch.Tensor, device: torch.device) -> None:
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


class _Health:
    """Per-stage activity and the collapse check on a few labelled calibration batches."""

    def __init__(self, loader: Iterable, n: int, device: torch.device, on_collapse: str):
        from .data import split_batch

        self.x, self.y = [], []
        with torch.random.fork_rng(devices=[]):  # drawing them must not move the global RNG
            for batch in loader:
                if len(self.x) >= n:
                    break
                x, y = split_batch(batch, where="the conversion loader")
                self.x.append(x.to(device))
                self.y.append(y)
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


def convert(
    model: nn.Module,
    loader: Iterable,
    *,
    T: int = 8,
    L: int | None = None,
    percentile: float = 99.9,
    per_channel: bool | None = None,
    calib_batches: int = 10,
    maxpool: str = "auto",
    reset: str = "subtract",
    bias_calibration: bool = True,
    bias_calibration_T: int | tuple[int, int] | None = None,
    threshold_calibration: bool | None = None,
    weight_calibration: bool | None = None,
    qcfs_epochs: int | None = None,
    qcfs_train: QCFSTrainConfig | None = None,
    finetune_epochs: int | None = None,
    finetune_config: Any = None,
    eval_loader: Iterable | None = None,
    eval_T: Iterable[int] = (),
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    on_collapse: str = "raise",
) -> tuple[SpikingNetwork, ConversionMeta]:
    """Convert a trained ReLU network into a spiking network of IF neurons.

    Runs prepare -> fold BatchNorm -> QCFS calibration (optionally QCFS training for
    ``qcfs_epochs``) -> IF replacement -> BPTT fine-tuning, with the no-BatchNorm guard after
    every stage. The caller's ``model`` is never changed. By default a labelled loader and a
    target ``T <= 8`` get one epoch of fine-tuning (at most :data:`FINETUNE_MAX_STEPS` optimiser
    steps, :func:`finetune_recipe`); ``finetune_epochs=0`` converts without training, which is
    also what an unlabelled loader, a loader of one batch or ``T >= 16`` gets.
    ``meta.settings["budget"]`` states the planned optimiser steps of each training stage, the
    steps that ran and their seconds, and the loader's length (one ANN training epoch) to
    compare them with.

    The returned network is a function of ``model``, the data, the settings and ``seed``:
    evaluation and progress never draw from the RNG that training uses, and a loader that
    shuffles with its own ``generator`` is left in the state it had on the call, so the same
    call again gives the same network.

    Args:
        model: a traceable ``nn.Module`` with ReLU activations.
        loader: batches of ``(x, y)``, ``[x, y]`` or bare ``x``; labels are needed only for
            QCFS training and fine-tuning. Validation data is split from it.
        T: time steps of the returned network (settable later with ``snn.T``).
        L: QCFS quantisation levels (default ``T``): those the QCFS-ANN is trained at
            (``qcfs_epochs``) and reported at (``meta.accuracy["qcfs"]``). After QCFS training
            every calibration targets the QCFS-ANN at these L levels over L steps (the function
            the network was trained for: an SNN at ``T = L`` then comes within a few points of
            its QCFS-ANN). With the default calibration and no QCFS training the SNN does not
            depend on it (thresholds come from the percentile, and the membrane and weight
            calibration target the QCFS-ANN at ``2 * T`` levels); the bias-only calibration
            (``bias_calibration_T`` an int) and ``reset="zero"`` calibrate against the
            QCFS-ANN at L.
        calib_batches: loader batches for the QCFS thresholds; bias and membrane calibration
            use the first ``min(4, calib_batches)`` of them, all at once for up to ``2 * T`` steps
            (their memory: a forward of that many batches at ``2 * T``; lower it here, or the
            loader's batch size, on a machine short of memory).
        maxpool: ``"auto"`` (default) keeps the max-pooling of the static analog prefix (the
            layers up to the first max-pooling that sees only the input, such as a ResNet stem:
            they run once in analog, exactly; :mod:`snnconv.prefix`) and replaces every later one
            by average pooling; ``"avg"`` replaces every one (a different function: see
            ``qcfs_epochs``); ``"error"`` refuses max-pooling, which binary spikes cannot compute.
        qcfs_epochs: epochs of QCFS-aware training of the ANN (needs labels; ``qcfs_train``
            sets the rest). ``None`` (default): where ``maxpool="avg"`` replaced max-pooling,
            576 optimiser steps rounded up to whole epochs of the training split (1 to 64: 16
            on the robustness matrix's 4,500 images, 2 on Fashion-MNIST or CIFAR-10 in batches
            of 128; on the matrix they lift the VGG's SNN at T=16 from 37 to 1.0 points under the ANN
            after 2 epochs of training, 30 to 1.45 after 10, worst seed),
            none otherwise (there one epoch changed little, or cost accuracy at T >= 16;
            benchmarks/README.md "QCFS training where max-pooling became average pooling").
        per_channel: one threshold per channel or one per layer. The default (None) is per
            channel for ``reset="subtract"`` (it won on 4 of 4 networks of the CPU matrix at
            T <= 16; benchmarks/README.md) and per layer for ``reset="zero"``, whose plain NIR
            ``IF`` nodes are read by consumers that need one threshold per layer
            (spikingjelly's NIR importer).
        eval_loader: optional labelled loader (a test set) to record accuracies in ``meta``;
            it is never used to choose anything.
        eval_T: extra T values at which to record SNN accuracy.
        reset: ``"subtract"`` (default: IF with reset by subtraction and ``v[0] = theta/2``,
            the exact QCFS equivalent) or ``"zero"`` (hard reset, ``v[0] = 0``: spikingjelly's
            ``IFNode(v_reset=0.)``, for NIR consumers and chips whose neurons reset to zero).
        bias_calibration: after IF replacement, shift biases so that each layer's mean output
            matches the QCFS-ANN on calibration batches (:func:`snnconv.calibration.calibrate_bias`).
            Raises accuracy at every T on deep networks; see the benchmarks.
        bias_calibration_T: the horizon(s) of bias calibration. ``None`` (default) with
            ``reset="subtract"``: the membrane calibration at ``2 * T`` steps
            (``calibrate_bias(membrane=True)``): each channel's initial membrane absorbs the
            error, the bias only what the membrane's range cannot, so the network converges to
            the ANN as it runs longer instead of keeping a bias that is right at one T (on the
            robustness matrix better than the two-horizon fit at T >= 16 and far better at
            T >= 32: benchmarks/README.md "Membrane-only calibration"). One integer
            calibrates the bias alone for that many steps (the default for ``reset="zero"``:
            ``T``; NIR's IF has no initial membrane). Two horizons ``(T1, T2)`` (subtractive
            reset) fit bias and initial membrane per channel as ``a + b / t``, exact at both
            (the default before; it decays beyond ``T2``).
        threshold_calibration: before bias calibration, fit each layer's threshold to the
            QCFS-ANN at ``bias_calibration_T`` steps
            (:func:`snnconv.calibration.calibrate_thresholds`; weights and the neuron model are
            untouched). ``None`` (default): on for ``reset="zero"``, whose neurons lose the
            charge above threshold at every spike and start empty; off for ``"subtract"``.
        weight_calibration: with bias calibration, also refit the weights of every Conv/Linear
            that reads spikes to the QCFS-ANN at the calibration's horizon
            (``calibrate_bias(weights=True)``, same pass: ridge least squares of each layer's
            output on the SNN's input rates). ``None`` (default): on with the membrane
            calibration (the default for ``reset="subtract"``): on the robustness matrix it
            lifted the mean at T=8 from 79.3 to 82.9% and the worst-seed T=16 gap of ResNet-20
            from 5.65 to 1.20 points, and cost up to 2 points at T=32 on briefly trained
            networks (benchmarks/README.md "Weight calibration"); off otherwise (not measured).
            It adds 20-40% to the calibration's time (ResNet-18, T=8, 2 CPU threads: 43 -> 61 s).
        finetune_epochs: epochs of BPTT fine-tuning (labels needed), each at most
            :data:`FINETUNE_MAX_STEPS` optimiser steps. ``None`` (default): 1 where the loader
            is labelled, has two batches or more and ``T <= 8`` (:data:`FINETUNE_UP_TO_T`), 0
            otherwise; 0 converts without training.
        finetune_config: a :class:`FinetuneConfig`; with ``distill > 0`` the original
            ``model`` is the teacher. Without one, ``finetune_epochs`` fine-tunes with
            :func:`finetune_recipe` (distillation from ``model``, trained thresholds, ATan
            alpha 4, lr 2e-3, batches of 64, smaller on small data sets so that an epoch has at
            least 256 steps (down to 16; :func:`_finetune_batch`), never larger than the
            loader's), unrolled for ``2 * T`` steps with the readouts at ``T // 2``, ``T`` and
            ``2 * T`` trained (the network holds from half its steps to twice them); the
            returned network keeps ``T``.
        on_collapse: ``"raise"`` (default) or ``"warn"``. After every stage, per-layer
            activity on the first two calibration batches goes into that stage's ``meta``
            record (``changes["activity"]``, see :mod:`snnconv.health`). A QCFS site that
            calibration left silent (where the ANN's ReLU was active) or saturated on all of
            them, or a network at chance there while the ANN is not, raises
            :class:`ConversionError` naming the layers (or warns). Silent SNN layers alone
            warn: a small T or hard reset can leave deep layers silent, and fine-tuning can
            bring them back.

    Returns:
        ``(snn, meta)``: the :class:`SpikingNetwork` and a :class:`ConversionMeta`.
    """
    from .finetune import FinetuneConfig, finetune

    eval_T = tuple(eval_T)
    if on_collapse not in ("raise", "warn"):
        raise ValueError(f"on_collapse must be 'raise' or 'warn', got {on_collapse!r}")
    T = int(T) if isinstance(T, numbers.Integral) and not isinstance(T, bool) else T
    for name, value in [("T", T), *(("eval_T", t) for t in eval_T)]:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} (time steps) must hold integers >= 1, got {value!r}")
    for name, data in (("loader", loader), ("eval_loader", eval_loader)):
        if isinstance(data, collections.abc.Iterator):
            raise DataError(
                f"{name} is a one-shot iterator ({type(data).__name__}); convert() reads it more "
                "than once (checks, calibration, training, evaluation). Pass a DataLoader or a "
                "list of batches instead.")
    if reset not in ("subtract", "zero"):
        raise ValueError(f"reset must be 'subtract' or 'zero', got {reset!r}")
    if L is None:
        L = T
    for name, value in (("finetune_epochs", finetune_epochs), ("qcfs_epochs", qcfs_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or value < 0):
            raise ValueError(f"{name} must be an integer >= 0 (or None for the default), got {value!r}")
    # a loader with its own generator is left as found: the same call gives the same network
    with generators_kept(loader, eval_loader):
        seed_everything(seed)
        device = torch.device(device)
        if threshold_calibration is None:
            threshold_calibration = reset == "zero"
        if per_channel is None:
            per_channel = reset == "subtract"
        membrane = bias_calibration_T is None and reset == "subtract"
        if weight_calibration is None:
            weight_calibration = membrane
        elif weight_calibration and not bias_calibration:
            raise ValueError("weight_calibration=True refits the weights inside bias calibration, which "
                             "bias_calibration=False turns off; pass bias_calibration=True or "
                             "weight_calibration=False")
        if bias_calibration_T is None:
            bias_calibration_T = 2 * T if reset == "subtract" else T
        if isinstance(bias_calibration_T, (tuple, list)):
            bias_calibration_T = tuple(bias_calibration_T)
            if reset != "subtract":
                raise ValueError("two calibration horizons move the initial membrane, which "
                                 "reset='zero' neurons do not have; give one T")
        horizons = bias_calibration_T if isinstance(bias_calibration_T, tuple) else None
        settings = dict(T=T, L=L, percentile=percentile, per_channel=per_channel,
                        bias_calibration=bias_calibration, bias_calibration_T=bias_calibration_T,
                        membrane_calibration=membrane and bool(bias_calibration),
                        threshold_calibration=bool(threshold_calibration),
                        weight_calibration=bool(weight_calibration and bias_calibration),
                        calib_batches=calib_batches, maxpool=maxpool, reset=reset, qcfs_epochs=qcfs_epochs,
                        finetune_epochs=finetune_epochs, device=str(device))
        if qcfs_train is not None and qcfs_epochs and qcfs_epochs != qcfs_train.epochs:
            raise ValueError(f"qcfs_epochs={qcfs_epochs} disagrees with qcfs_train.epochs="
                             f"{qcfs_train.epochs}; give one of them")
        if finetune_config is not None and finetune_epochs and finetune_epochs != finetune_config.epochs:
            raise ValueError(f"finetune_epochs={finetune_epochs} disagrees with finetune_config.epochs="
                             f"{finetune_config.epochs}; give one of them")
        x0, y0 = first_batch(loader, where="the conversion loader")
        if finetune_epochs is None and finetune_config is None:
            why = None
            if y0 is None:
                why = "the loader has no labels"
            elif T > FINETUNE_UP_TO_T:
                why = f"T={T} > {FINETUNE_UP_TO_T}"
            elif _batches_below(loader, 2):
                why = "the loader has one batch (none to validate on)"
            finetune_epochs = 0 if why else 1
            settings["finetune_epochs"] = finetune_epochs
            settings["finetune_default"] = f"none: {why}" if why else "one epoch (T <= 8, labelled)"
        if finetune_config is None and finetune_epochs:
            finetune_config = finetune_recipe(T, loader, epochs=finetune_epochs, seed=seed,
                                              max_steps=FINETUNE_MAX_STEPS, reset=reset)
        if finetune_config is not None:
            settings["finetune"] = vars(finetune_config).copy()
        meta = ConversionMeta(settings=settings, seed=seed)

        with _stage(meta, "prepare") as rec:
            gm = prepare(model)
            _check_weights(gm)
            gm.to(device)
            _check_batch(gm, x0, device)
            rec.changes = {"input_shape": list(x0.shape),
                           "parameters": sum(p.numel() for p in gm.parameters()),
                           "constructs": rewrite_constructs(gm, (x0.to(device),), maxpool=maxpool)}
            maxpool = "error" if maxpool == "error" else "avg"  # the prefix's max-pooling is kept
            health = _Health(loader, min(2, calib_batches) if isinstance(calib_batches, int) else 2,
                             device, on_collapse)
            health.finetune_follows = finetune_config is not None and finetune_config.epochs > 0
        if eval_loader is not None:
            meta.accuracy["ann"] = evaluate(gm, eval_loader, device)
        qcfs_train = _qcfs_training(qcfs_epochs, qcfs_train, maxpool, gm, health, seed, loader)
        settings["qcfs_epochs"] = qcfs_train.epochs if qcfs_train is not None else 0
        if qcfs_train is not None:
            settings["qcfs_train"] = vars(qcfs_train).copy()
        settings["budget"] = _budget(loader, qcfs_train, finetune_config)
        if qcfs_train is not None and qcfs_train.epochs and membrane:
            # trained at L levels: calibrate against that function, over L steps
            bias_calibration_T = L
            settings["bias_calibration_T"] = L

        with _stage(meta, "fold") as rec:
            pairs = fold_graph(gm, (x0.to(device),))
            assert_no_batchnorm(gm, stage="fold")
            rec.changes = {"folded": [p.to_dict() for p in pairs],
                           "max_abs_diff": max((p.max_abs_diff or 0.0 for p in pairs), default=0.0)}
            health.check(rec, gm, "fold", what="the (folded) ANN")
        if eval_loader is not None:
            meta.accuracy["folded"] = evaluate(gm, eval_loader, device)

        with _stage(meta, "qcfs") as rec:
            qgm = calibrate_qcfs(gm, loader, L=L, percentile=percentile, per_channel=per_channel,
                                 num_batches=calib_batches, maxpool=maxpool, train=qcfs_train,
                                 device=device, progress=progress)
            assert_no_batchnorm(qgm, stage="qcfs")
            rec.changes = dict(qgm.meta["qcfs"])
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
            snn = to_spiking(qgm, T=T, reset=reset)
            if threshold_calibration:
                snn = calibrate_thresholds(snn, qgm, loader,
                                           T=T if horizons or membrane else bias_calibration_T,
                                           num_batches=_bias_batches(calib_batches))
            if bias_calibration:
                snn = calibrate_bias(snn, qgm, loader, T=None if horizons else bias_calibration_T,
                                     horizons=horizons, membrane=membrane, weights=bool(weight_calibration),
                                     num_batches=_bias_batches(calib_batches))
            snn.meta["input_shape"] = list(x0.shape[1:])  # batch-free; export_nir's default
            snn.to(device)
            assert_no_batchnorm(snn, stage="spiking")
            rec.changes = dict(snn.meta)
            if_source = {n: qcfs_source.get(r.get("source"), r.get("source"))
                         for n, r in snn.meta["neurons"].items()}
            health.check(rec, snn, "spiking", what=f"the SNN at T={T}", source=if_source)

        if finetune_config is not None and finetune_config.epochs > 0:
            with _stage(meta, "finetune") as rec:
                # distillation learns from the caller's ANN (finetune() works on its own copy)
                teacher = model if finetune_config.distill > 0 else None
                snn, history = finetune(snn, loader, config=finetune_config, teacher=teacher,
                                        device=device, progress=progress)
                assert_no_batchnorm(snn, stage="finetune")
                rec.changes = {"history": history, "steps": sum(h.get("steps", 0) for h in history)}
                health.check(rec, snn, "finetune", what=f"the fine-tuned SNN at T={T}", source=if_source)

        if eval_loader is not None:
            Ts = sorted(set(eval_T) | {T})
            meta.accuracy["snn"] = {str(t): a for t, a in
                                    accuracy_by_T(snn, eval_loader, Ts, device).items()}
        _record_budget(meta)
        return snn, meta


def _record_budget(meta: ConversionMeta) -> None:
    """What the training stages ran: optimiser steps and seconds, beside the plan."""
    budget = meta.settings.get("budget", {})
    for record in meta.stages:
        if record.name == "qcfs" and record.changes.get("history"):
            budget["qcfs_steps_run"] = sum(h.get("steps", 0) for h in record.changes["history"])
            budget["qcfs_seconds"] = record.seconds
        if record.name == "finetune":
            budget["finetune_steps_run"] = record.changes.get("steps", 0)
            budget["finetune_seconds"] = record.seconds
    budget["total_seconds"] = sum(r.seconds for r in meta.stages)
