"""ConvertConfig: every setting of :func:`snnconv.convert`, validated once, with the defaults
that depend on one another resolved in one place.

``ConvertConfig(**settings)`` checks types, ranges and contradictions (raising
:class:`~snnconv.errors.ConfigError`, a ``ValueError`` too); :meth:`ConvertConfig.resolved`
fills in the defaults that follow from the others (``L`` from ``T``, the threshold granularity
and calibration passes from ``reset``). What depends on the data (fine-tuning by default only
with labels, QCFS training where max-pooling became average pooling) is decided by
:func:`snnconv.convert`, which records every decision in ``meta.settings``.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from snnconv.errors import ConfigError
from snnconv.vocabulary import MAX_BURST, MAX_T, RESETS

__all__ = ["ConvertConfig", "MAX_T", "MAX_L", "MAX_EPOCHS", "MAXPOOL_MODES", "RESETS"]

#: The most QCFS quantisation levels (the ANN's activations take L + 1 values).
MAX_L = 1024
#: The most epochs of QCFS training or fine-tuning one call may ask for.
MAX_EPOCHS = 10_000
#: The most optimiser steps of the reconstruction one call may ask for.
MAX_STEPS = 1_000_000
#: ``maxpool`` settings: "auto" keeps the max-pooling of the static analog prefix (snnconv.constructs.prefix)
#: and makes every later one average pooling; "avg" makes every one average pooling; "error"
#: refuses max-pooling.
MAXPOOL_MODES = ("auto", "avg", "error")


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer between {low} and {high}, got "
                          f"{value!r} ({type(value).__name__})")
    if not low <= int(value) <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {value}")
    return int(value)


def _choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value


def _flag(name: str, value: Any, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False{' (or None for the default)' if optional else ''}, "
                          f"got {value!r}")
    return value


@dataclass(frozen=True)
class ConvertConfig:
    """The settings of :func:`snnconv.convert`. Where a default is ``None``, convert() decides it
    from the data and the traced model (:func:`snnconv.defaults.plan_conversion`) and records
    the decision and its reason in ``meta.settings``.

    Fields:
        T: time steps of the returned network (settable later with ``snn.T``), 1 to
            :data:`MAX_T`.
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
            exactly: :mod:`snnconv.constructs.prefix`) and makes every later one average pooling; ``"avg"``
            makes every one average pooling, a different function, which QCFS training then
            adapts the weights to (see ``qcfs_epochs``); ``"error"`` refuses max-pooling.
        qcfs_epochs: epochs of QCFS-aware training of the ANN (``qcfs_train`` sets the rest;
            with an unlabelled loader the targets are ``model``'s outputs alone). ``None``
            (default): :data:`~snnconv.defaults.QCFS_STEPS` optimiser steps (in whole epochs of the training
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
        calibration_reference: what the bias (membrane) and weight calibrations match each
            layer to: ``"qcfs"`` (default) the QCFS-ANN, quantised at the calibration's horizon;
            ``"ann"`` the network with ReLU at every site, no clip and no quantisation (the
            ANN's own weights where no QCFS training ran): each layer's bias then also absorbs
            the mean error of clipping at its threshold (Nagel et al., ICCV 2019; Li et al.,
            ICML 2021).
        hard_rate: with ``reset="zero"``, every QCFS site computes the rate of the reset-to-zero
            neuron that replaces it at T (:class:`~snnconv.activation.QCFS` ``hard_T``: a
            staircase with levels 1, 1/2, 1/3, ... of the threshold, not QCFS's even steps), and
            QCFS training (:data:`~snnconv.defaults.QCFS_STEPS` optimiser steps where
            ``qcfs_epochs`` is None) adapts the ANN to it; every calibration then targets it.
            Default: on for ``reset="zero"`` where the loader has two batches or more and
            ``qcfs_epochs`` is not 0 (untrained, the staircase is a poor reference).
        threshold_calibration: fit each layer's threshold to the QCFS-ANN before the bias
            calibration (:func:`snnconv.calibration.calibrate_thresholds`). Default: on for
            ``reset="zero"`` only.
        weight_calibration: with bias calibration, refit the weights of every layer that reads
            spikes to the QCFS-ANN (ridge least squares). Default: with the membrane
            calibration.
        membrane_calibration: with bias calibration, correct each channel through its initial
            membrane (the bias gets what the membrane's range cannot) at ``bias_calibration_T``
            steps (default ``2 * T``); ``False``: the bias alone, at ``bias_calibration_T``
            (default ``T``). Default: on for ``reset="subtract"`` without two horizons; hard-reset
            neurons have no initial membrane to move.
        reconstruction_steps: optimiser steps of the layer-wise reconstruction after the
            calibration (:func:`snnconv.calibration.reconstruct`: every IF layer's spike rate
            over T steps fitted by SGD to the QCFS-ANN's site, on the calibration batches; no
            label is read). ``None`` (default): :data:`~snnconv.defaults.RECONSTRUCT_STEPS` where neither QCFS
            training ran nor fine-tuning follows and ``T <= 8`` (subtractive reset, bias
            calibration on); 0 otherwise.
        finetune_epochs: epochs of BPTT fine-tuning, each at most :data:`~snnconv.defaults.FINETUNE_MAX_STEPS`
            optimiser steps; with an unlabelled loader the targets are ``model``'s outputs
            alone (:data:`~snnconv.defaults.LABEL_FREE_DISTILL`). ``None`` (default): where the loader has two
            batches or more and ``T <= 8`` (:data:`~snnconv.defaults.FINETUNE_UP_TO_T`),
            the epochs that reach :data:`~snnconv.defaults.FINETUNE_MIN_STEPS` steps (1 to
            :data:`~snnconv.defaults.FINETUNE_MAX_EPOCHS`); 0 otherwise.
        finetune_config: a :class:`FinetuneConfig`; with ``distill > 0`` the original
            ``model`` is the teacher. Without one, :func:`~snnconv.defaults.finetune_recipe`.
        eval_T: extra T values at which to record SNN accuracy (with ``eval_loader``).
        seed: seeds Python, numpy and torch before any stage.
        device: where the stages run.
        progress: progress bars (False silences them).
        burst: the most spikes a neuron may emit in one step (default 1: binary spikes). With
            B > 1 (subtractive reset) each neuron's threshold is lambda / B and its rate over T
            steps has T * B levels (QCFS at ``L = T * B`` by default): graded spikes, as Loihi 2
            carries them (NIR export writes B ``Threshold`` nodes per neuron and their sum). It
            costs no time step; it addresses the quantisation that :func:`snnconv.diagnose` measures.
        early_exit: convert for early exit (each image stops at the step where its answer is
            sure, :mod:`snnconv.exit_rule`): fine-tuning trains the readouts after 1, 2, 4, ...
            up to 2T steps (:func:`~snnconv.defaults.anytime_horizons`) instead of T/2, T and 2T
            at any T (the default does so from T = :data:`~snnconv.defaults.ANYTIME_FROM_T`),
            and is kept where it does better on the held-out images over those readouts and
            is not worse at T beyond their noise; then
            an exit rule is calibrated on the held-out images
            (:data:`~snnconv.exit_rule.DEFAULT_TOLERANCE` points of the fixed T) and stored in
            ``snn.meta`` (:func:`snnconv.evaluate_exit`, NIR export and the backends use it).
            The network then answers well after one or two steps, for a few tenths of a point
            at the fixed T (the Defaults row "early exit").
        on_collapse: ``"raise"`` (default) or ``"warn"``. After every stage, per-layer activity
            on the first two calibration batches goes into that stage's ``meta`` record
            (:mod:`snnconv.analysis.health`). A QCFS site left silent or saturated, or a network at
            chance while the ANN is not, raises :class:`ConversionError` naming the layers.
            Silent SNN layers alone warn: fine-tuning can bring them back.

    Raises:
        ConfigError: a value of the wrong type or out of range (the message gives the bound),
            or two settings that contradict each other.
    """

    T: int = 8
    L: int | None = None
    percentile: float = 99.9
    per_channel: bool | None = None
    calib_batches: int = 10
    maxpool: str = "auto"
    reset: str = "subtract"
    bias_calibration: bool = True
    bias_calibration_T: int | tuple[int, int] | None = None
    calibration_reference: str = "qcfs"
    threshold_calibration: bool | None = None
    hard_rate: bool | None = None
    weight_calibration: bool | None = None
    qcfs_epochs: int | None = None
    qcfs_train: Any = None
    reconstruction_steps: int | None = None
    finetune_epochs: int | None = None
    finetune_config: Any = None
    eval_T: tuple[int, ...] = ()
    seed: int = 0
    device: Any = "cpu"
    progress: bool = True
    on_collapse: str = "raise"
    burst: int = 1
    membrane_calibration: bool | None = None
    early_exit: bool = False

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        put("T", _int("T (time steps)", self.T, 1, MAX_T))
        if self.L is not None:
            put("L", _int("L (QCFS levels)", self.L, 1, MAX_L))
        if isinstance(self.percentile, bool) or not isinstance(self.percentile, numbers.Real) \
                or not 0 < float(self.percentile) <= 100:
            raise ConfigError(f"percentile must be a number in (0, 100], got {self.percentile!r}")
        put("percentile", float(self.percentile))
        put("calib_batches", _int("calib_batches", self.calib_batches, 1, 100_000))
        _choice("maxpool", self.maxpool, MAXPOOL_MODES)
        _choice("reset", self.reset, RESETS)
        put("burst", _int("burst (spikes a neuron may emit in one step)", self.burst, 1, MAX_BURST))
        if self.burst > 1 and self.reset != "subtract":
            raise ConfigError(f"a burst neuron (burst={self.burst}) resets by subtraction: reset='zero' "
                              "would drop the charge beyond one threshold. Use burst=1 with reset='zero'")
        _choice("on_collapse", self.on_collapse, ("raise", "warn"))
        _choice("calibration_reference", self.calibration_reference, ("qcfs", "ann"))
        for name in ("per_channel", "threshold_calibration", "weight_calibration", "membrane_calibration",
                     "hard_rate"):
            _flag(name, getattr(self, name), optional=True)
        _flag("bias_calibration", self.bias_calibration)
        _flag("early_exit", self.early_exit)
        _flag("progress", self.progress)
        put("seed", _int("seed", self.seed, 0, 2**63 - 1))
        if isinstance(self.eval_T, (str, bytes)) or not hasattr(self.eval_T, "__iter__"):
            raise ConfigError(f"eval_T must be a sequence of time steps, got {self.eval_T!r}")
        put("eval_T", tuple(_int("eval_T", t, 1, MAX_T) for t in self.eval_T))
        horizon = self.bias_calibration_T
        if isinstance(horizon, (tuple, list)):
            if len(horizon) != 2:
                raise ConfigError(f"bias_calibration_T takes one T or two horizons (T1, T2), got {horizon!r}")
            put("bias_calibration_T", tuple(_int("bias_calibration_T", t, 1, MAX_T) for t in horizon))
            if self.reset != "subtract":
                raise ConfigError("two calibration horizons move the initial membrane, which "
                                  "reset='zero' neurons do not have; give one T")
        elif horizon is not None:
            put("bias_calibration_T", _int("bias_calibration_T", horizon, 1, MAX_T))
        for name in ("qcfs_epochs", "finetune_epochs"):
            if getattr(self, name) is not None:
                put(name, _int(f"{name} (or None for the default)", getattr(self, name), 0, MAX_EPOCHS))
        if self.reconstruction_steps is not None:
            put("reconstruction_steps", _int("reconstruction_steps (or None for the default)",
                                             self.reconstruction_steps, 0, MAX_STEPS))
        if self.weight_calibration and not self.bias_calibration:
            raise ConfigError("weight_calibration=True refits the weights inside bias calibration, which "
                              "bias_calibration=False turns off; pass bias_calibration=True or "
                              "weight_calibration=False")
        if self.membrane_calibration and not self.bias_calibration:
            raise ConfigError("membrane_calibration=True moves the initial membranes inside bias calibration, "
                              "which bias_calibration=False turns off; pass bias_calibration=True or "
                              "membrane_calibration=False")
        if self.hard_rate and self.reset != "zero":
            raise ConfigError(f"hard_rate=True trains the ANN for reset-to-zero neurons, but reset="
                              f"{self.reset!r}; pass reset='zero', or leave hard_rate out")
        if self.membrane_calibration and self.reset != "subtract":
            raise ConfigError(f"membrane_calibration=True with reset={self.reset!r}: hard-reset neurons start "
                              "at 0 and have no initial membrane to move; pass membrane_calibration=False "
                              "(or leave it out) with reset='zero'")
        if self.membrane_calibration and isinstance(self.bias_calibration_T, tuple):
            raise ConfigError(f"membrane_calibration=True with two horizons bias_calibration_T="
                              f"{self.bias_calibration_T}: two horizons fit the bias and the membrane "
                              "together; give one horizon, or leave membrane_calibration out")
        for epochs, cfg, kind in ((self.qcfs_epochs, self.qcfs_train, "qcfs_train"),
                                  (self.finetune_epochs, self.finetune_config, "finetune_config")):
            if cfg is not None and not isinstance(getattr(cfg, "epochs", None), numbers.Integral):
                wanted = "QCFSTrainConfig" if kind == "qcfs_train" else "FinetuneConfig"
                raise ConfigError(f"{kind} must be a {wanted}, "
                                  f"got {type(cfg).__name__}")
            if cfg is not None and epochs and epochs != cfg.epochs:
                raise ConfigError(f"{kind.split('_')[0]}_epochs={epochs} disagrees with {kind}.epochs="
                                  f"{cfg.epochs}; give one of them")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "ConvertConfig":
        """A config from keyword arguments, naming any that is not a setting."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"convert() has no setting {', '.join(map(repr, unknown))}; the settings "
                              f"are {', '.join(sorted(names))}")
        return cls(**options)

    def options(self) -> dict[str, Any]:
        """The fields as keyword arguments (a resolved config stays resolved)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "ConvertConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    #: The fields :meth:`resolved` fills in where they are ``None``.
    DEPENDENT = ("L", "per_channel", "threshold_calibration", "weight_calibration", "bias_calibration_T",
                 "membrane_calibration")

    @property
    def is_resolved(self) -> bool:
        """Whether every default that follows from the others (:data:`DEPENDENT`) is filled in."""
        return all(getattr(self, name) is not None for name in self.DEPENDENT)

    def resolved(self) -> "ConvertConfig":
        """The same settings with the defaults that follow from the others filled in, each where
        it is ``None``: ``L = T`` (``T * burst``); per-channel thresholds for subtractive reset,
        per layer for hard reset; the threshold fit for hard reset only; the membrane calibration
        with bias calibration where the reset is subtractive and no horizon is given; its horizon
        ``2 * T``, the bias alone's ``T``; the weight refit with the membrane calibration."""
        if self.is_resolved:
            return self
        membrane = (self.bias_calibration and self.bias_calibration_T is None and self.reset == "subtract"
                    if self.membrane_calibration is None else self.membrane_calibration)
        return dataclasses.replace(
            self, L=self.T * self.burst if self.L is None else self.L,
            per_channel=self.reset == "subtract" if self.per_channel is None else self.per_channel,
            threshold_calibration=(self.reset == "zero" if self.threshold_calibration is None
                                   else self.threshold_calibration),
            weight_calibration=(membrane and self.bias_calibration if self.weight_calibration is None
                                else self.weight_calibration),
            bias_calibration_T=((2 * self.T if membrane else self.T)
                                if self.bias_calibration_T is None else self.bias_calibration_T),
            membrane_calibration=membrane)

    @property
    def horizons(self) -> tuple[int, int] | None:
        """The two calibration horizons, where given."""
        return self.bias_calibration_T if isinstance(self.bias_calibration_T, tuple) else None

    @property
    def bias_batches(self) -> int:
        """Batches of bias/membrane calibration: 4, or fewer where ``calib_batches`` is smaller."""
        return min(4, self.calib_batches)

    def settings(self) -> dict[str, Any]:
        """The resolved settings as ``meta.settings`` records them (JSON-ready)."""
        cfg = self.resolved()
        return dict(T=cfg.T, L=cfg.L, percentile=cfg.percentile, per_channel=cfg.per_channel,
                    bias_calibration=cfg.bias_calibration, bias_calibration_T=cfg.bias_calibration_T,
                    calibration_reference=cfg.calibration_reference,
                    membrane_calibration=bool(cfg.membrane_calibration and cfg.bias_calibration),
                    threshold_calibration=bool(cfg.threshold_calibration), hard_rate=bool(cfg.hard_rate),
                    weight_calibration=bool(cfg.weight_calibration and cfg.bias_calibration),
                    calib_batches=cfg.calib_batches, maxpool=cfg.maxpool, reset=cfg.reset,
                    qcfs_epochs=cfg.qcfs_epochs, reconstruction_steps=cfg.reconstruction_steps,
                    finetune_epochs=cfg.finetune_epochs, burst=cfg.burst, early_exit=cfg.early_exit,
                    device=str(torch.device(cfg.device)))
