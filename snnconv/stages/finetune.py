"""The `finetune` stage: BPTT fine-tuning of a converted SNN with spikingjelly's atan surrogate.

Cross-entropy on the T-averaged readout, SGD or AdamW with warm-up and a cosine schedule,
gradient clipping, thresholds frozen by default. Resumable: a checkpoint (model, optimiser,
scheduler, RNG, position) is written atomically every epoch and optionally every N steps; a
killed run resumed with ``resume=True`` ends bit-identical to an uninterrupted one on CPU.
Runs under ``torchrun`` with DistributedDataParallel (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import math
import os
import time
from collections.abc import Sized
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable

import torch
import torch.nn as nn

from snnconv.analysis.metrics import TeacherLabelled, accuracy_by_T, distillation_loss, evaluate, teacher_targets
from snnconv.data import SameShape, bounded, split_batch
from snnconv.distributed import (
    all_reduce_sum,
    local_device,
    maybe_init_distributed,
    rank_world,
    rng_state,
    set_rng_state,
)
from snnconv.errors import CheckpointError, ConfigError, DataError, StageOrderError
from snnconv.io.checkpoint import check_checkpoint, read_checkpoint, write_checkpoint
from snnconv.progress import progress_bar
from snnconv.recompute import StepBudget, checkpointed, plan_step
from snnconv.snn.network import SpikingNetwork
from snnconv.snn.neuron import neurons
from snnconv.stages.finetune_data import TrainingData, training_data, training_size
from snnconv.stages.qcfs import make_optimizer

__all__ = ["FinetuneConfig", "finetune", "blend", "checkpointed", "read_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "finetune.ckpt"


@dataclass(frozen=True)
class FinetuneConfig:
    """BPTT fine-tuning settings (validated on construction).

    The main ones: ``epochs`` and ``T`` (steps unrolled), ``optimizer`` ("sgd" | "adamw"),
    ``lr`` with ``warmup_steps`` of linear warm-up then cosine decay, ``grad_clip`` (0: off),
    ``alpha`` (ATan surrogate sharpness) and ``detach_reset``, ``train_thresholds`` (with
    ``threshold_lr``; never weight-decayed, kept positive), ``val_fraction`` of the training
    data held out to pick the best epoch, ``checkpoint_dir``/``checkpoint_every``/``resume``,
    ``activation_checkpointing`` (``"auto"``, None, ``"block"``, ``"neuron"``) and
    ``micro_batch`` (images per forward/backward pass; None: as many as fit the memory, see
    :func:`snnconv.recompute.plan_step`), ``amp`` (CUDA only), and
    ``horizons``: step counts h <= T whose running-average readouts each get a cross-entropy
    term (e.g. ``(2, 4)`` at T=4 trains the network to answer well after 2 steps too); the
    best epoch is then the one with the best mean validation accuracy over them.
    ``horizon_weights`` (one positive weight per horizon, in the order given; default: equal)
    weighs their terms, and the validation accuracies, in that mean.
    ``distill`` in [0, 1] mixes knowledge distillation from a ``teacher`` ANN (usually the ANN
    that was converted) into every readout's loss: ``(1 - distill) * CE + distill * tau^2 *
    KL(teacher || snn)`` at temperature ``distill_temperature`` (tau); at ``distill=1`` the
    loader needs no labels (the teacher's outputs are the only targets, and the accuracies
    recorded for an unlabelled split are top-1 agreement with the teacher). ``keep_start``: the
    network as given competes as epoch 0 in the best-epoch choice (one validation pass more),
    its score lowered by one standard error (:func:`start_margin`): fine-tuning never returns
    a network worse on validation than it was given by more than the split's noise, and a
    trained epoch wins a tie within it. ``per_step`` in [0, 1] weighs in a loss at every time
    step (TET, Deng et al., arXiv 2202.11946): the mean over the T steps of each step's own
    readout's loss, ``(1 - per_step) * readout loss + per_step * mean_t loss(out_t)``, which
    asks every step to answer rather than only their average.
    """

    epochs: int = 1
    T: int = 4
    optimizer: str = "adamw"
    lr: float = 1e-3  # AdamW; measured on the Fashion-MNIST ResNet-14: 1e-3 >> 1e-4 in 2 epochs
    weight_decay: float = 0.0
    momentum: float = 0.9
    warmup_steps: int = 0
    batch_size: int | None = None
    alpha: float = 2.0
    detach_reset: bool = False
    label_smoothing: float = 0.0
    grad_clip: float = 1.0
    train_thresholds: bool = False
    threshold_lr: float | None = None
    val_fraction: float = 0.1
    max_steps_per_epoch: int | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    activation_checkpointing: str | None = "auto"
    micro_batch: int | None = None
    amp: bool = True
    horizons: tuple[int, ...] | None = None
    horizon_weights: tuple[float, ...] | None = None
    distill: float = 0.0
    distill_temperature: float = 2.0
    wise: float = 0.0
    keep_start: bool = False
    per_step: float = 0.0

    def __post_init__(self):
        def bad(msg):
            raise ConfigError(f"FinetuneConfig: {msg}")

        if isinstance(self.T, bool) or not isinstance(self.T, int) or self.T < 1:
            bad(f"T must be an integer >= 1, got {self.T!r}")
        if not isinstance(self.epochs, int) or self.epochs < 0:
            bad(f"epochs must be an integer >= 0, got {self.epochs!r}")
        if self.optimizer not in ("sgd", "adamw"):
            bad(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.lr <= 0 or (self.threshold_lr is not None and self.threshold_lr <= 0):
            bad(f"learning rates must be positive (lr={self.lr}, threshold_lr={self.threshold_lr})")
        if not 0 <= self.val_fraction < 1:
            bad(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.alpha <= 0:
            bad(f"alpha must be positive, got {self.alpha}")
        if not 0 <= self.label_smoothing < 1:
            bad(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0 <= self.distill <= 1:
            bad(f"distill must be in [0, 1], got {self.distill}")
        if self.distill_temperature <= 0:
            bad(f"distill_temperature must be positive, got {self.distill_temperature}")
        if not 0 <= self.per_step <= 1:
            bad(f"per_step must be the per-step loss's weight in [0, 1], got {self.per_step}")
        if not 0 <= self.wise < 1:
            bad(f"wise must be the start's weight in [0, 1), got {self.wise}")
        if self.weight_decay < 0:
            bad(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            bad(f"momentum must be in [0, 1), got {self.momentum}")
        if self.grad_clip < 0:
            bad(f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if self.activation_checkpointing not in ("auto", None, "block", "neuron"):
            bad(f"activation_checkpointing must be 'auto', None, 'block' or 'neuron', got "
                f"{self.activation_checkpointing!r}")
        if self.micro_batch is not None and (isinstance(self.micro_batch, bool)
                                             or not isinstance(self.micro_batch, int) or self.micro_batch < 1):
            bad(f"micro_batch must be None or an integer >= 1, got {self.micro_batch!r}")
        if self.checkpoint_every < 0 or self.warmup_steps < 0:
            bad("checkpoint_every and warmup_steps must be >= 0")
        if self.batch_size is not None and self.batch_size < 1:
            bad(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            bad(f"max_steps_per_epoch must be >= 1, got {self.max_steps_per_epoch}")
        if self.horizons is not None:
            if not self.horizons or any(isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= self.T
                                        for h in self.horizons):
                bad(f"horizons must be step counts in [1, T={self.T}], got {self.horizons!r}")
            given = tuple(self.horizons)
            object.__setattr__(self, "horizons", tuple(sorted(set(given))))
            if self.horizon_weights is not None:
                w = tuple(self.horizon_weights)
                if len(w) != len(given) or len(set(given)) != len(given) or any(
                        isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf for v in w):
                    bad(f"horizon_weights must be one positive weight per horizon {given!r} (each horizon once), "
                        f"got {self.horizon_weights!r}")
                by_h = dict(zip(given, (float(v) for v in w)))
                object.__setattr__(self, "horizon_weights", tuple(by_h[h] for h in self.horizons))
        elif self.horizon_weights is not None:
            bad("horizon_weights weigh the horizons' readouts: give horizons too")

    def horizon_weight(self) -> dict[int, float]:
        """Each trained horizon's share of the loss and of the validation score (they sum to 1)."""
        hs = self.horizons or ()
        w = self.horizon_weights or (1.0,) * len(hs)
        total = sum(w)
        return {h: v / total for h, v in zip(hs, w)}


# --- checkpoint files -----------------------------------------------------------------------

def _fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    return h.hexdigest()


def _weights_digest(model: nn.Module) -> str:
    """sha256 of the network's values (not only its shapes): the network a run started from."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- training -------------------------------------------------------------------------------

# Settings that decide the training trajectory: a checkpoint written under other values cannot
# continue this run (activation checkpointing, checkpoint cadence and paths change nothing).
_RESUME_KEYS = ("epochs", "T", "optimizer", "lr", "weight_decay", "momentum", "warmup_steps",
                "alpha", "detach_reset", "label_smoothing", "grad_clip", "train_thresholds",
                "threshold_lr", "val_fraction", "max_steps_per_epoch", "seed", "amp", "horizons",
                "horizon_weights", "distill", "distill_temperature", "per_step")


def _lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if total <= warmup:
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
    return f


def finetune(
    snn: SpikingNetwork,
    train_loader: Iterable,
    *,
    T: int | None = None,
    epochs: int | None = None,
    config: FinetuneConfig | None = None,
    teacher: nn.Module | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    **options: Any,
) -> tuple[SpikingNetwork, list[dict[str, float]]]:
    """Train a converted SNN through T time steps with the atan surrogate (BPTT).

    Works on a copy of ``snn``. The validation split is taken from ``train_loader`` and picks
    the best epoch. ``options`` override fields of ``config`` (see :class:`FinetuneConfig`).
    ``teacher`` (an ANN mapping the same inputs to the same classes; used on a copy, in eval
    mode) is required when ``distill > 0``.
    The result depends on ``seed`` only: the caller's global RNG is neither read nor changed.

    Returns:
        ``(snn, history)``: the fine-tuned network (at the same T as given) and one record per
        epoch (loss, train/val accuracy, seconds).

    Raises:
        StageOrderError: ``snn`` is not a SpikingNetwork.
        DataError: the loader has no labels (and ``distill < 1``), or is empty.
        CheckpointError: a checkpoint to resume is corrupted, from another model, or from a
            run with other settings.
    """
    if not isinstance(snn, SpikingNetwork):
        raise StageOrderError(
            f"finetune() expects a SpikingNetwork from snnconv.to_spiking/convert, got "
            f"{type(snn).__name__}; convert the ANN first")
    cfg = config or FinetuneConfig()
    if T is not None:
        options["T"] = T
    if epochs is not None:
        options["epochs"] = epochs
    if options:
        unknown = set(options) - set(FinetuneConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"finetune() got unknown options {sorted(unknown)}")
        cfg = replace(cfg, **options)
    if (teacher is None) != (cfg.distill == 0):
        raise ConfigError(
            f"distillation needs both a teacher and distill > 0; got teacher="
            f"{type(teacher).__name__ if teacher is not None else None} and distill={cfg.distill}")
    if teacher is not None and not isinstance(teacher, nn.Module):
        raise ConfigError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
    device = local_device(torch.device(device))
    maybe_init_distributed(device)
    rank, world = rank_world()
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        return _finetune(snn, train_loader, cfg, teacher, device, progress and rank == 0, rank, world)


def _check_resumable(path: str, state: dict, fingerprint: str, cfg: FinetuneConfig,
                     global_batch: int | None, start_digest: str, data_size: int | None) -> None:
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path} was written for another model (parameter names/shapes differ); "
            "point checkpoint_dir elsewhere or delete the file")
    if state.get("start_digest", start_digest) != start_digest:
        raise CheckpointError(
            f"{path} was written by a run that started from other weights (same shapes, other "
            "values): resume with the network that run was given, or point checkpoint_dir "
            "elsewhere to start a new run")
    if state.get("data_size", data_size) != data_size:
        raise CheckpointError(
            f"{path} was written by a run over other data ({state.get('data_size')} training "
            f"samples or batches, now {data_size}): resume with the same data (shuffling and "
            "augmentation are fine), or point checkpoint_dir elsewhere")
    saved = state.get("config", {})
    now = asdict(cfg)
    # a setting added after the checkpoint was written had its default value in that run
    then = {k: saved.get(k, FinetuneConfig.__dataclass_fields__[k].default) for k in _RESUME_KEYS}
    diffs = [f"{k}: checkpoint {then[k]!r}, now {now[k]!r}" for k in _RESUME_KEYS
             if then[k] != now[k]]
    if state.get("global_batch") != global_batch:
        diffs.append(f"global batch: checkpoint {state.get('global_batch')}, now {global_batch}")
    if diffs:
        raise CheckpointError(
            f"{path} was written by a run with other settings ({'; '.join(diffs)}); resume with "
            "the same settings, or point checkpoint_dir elsewhere to start a new run")


def _readout_loss(logits: torch.Tensor, y: torch.Tensor, soft: torch.Tensor | None,
                  cfg: FinetuneConfig) -> torch.Tensor:
    """Cross-entropy of one readout, mixed with distillation from the teacher's ``soft`` targets."""
    return distillation_loss(logits, y, soft, weight=cfg.distill, temperature=cfg.distill_temperature,
                             label_smoothing=cfg.label_smoothing, where="the fine-tuning loader")


def _step_plan(model: SpikingNetwork, x: torch.Tensor, cfg: FinetuneConfig, device: torch.device,
               world: int) -> StepBudget:
    """:func:`plan_step` for this run's batches; under DDP every process takes the smallest
    micro-batch and the most checkpointing any of them needs."""
    plan = plan_step(model, x, len(x), cfg.activation_checkpointing, cfg.micro_batch)
    if world == 1:
        return plan
    import torch.distributed as dist

    agreed = torch.tensor([-plan.micro_batch, plan.mode == "block"], dtype=torch.int64,
                          device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return StepBudget("block" if agreed[1] else plan.mode, int(-agreed[0]), plan.per_image)


def _runner(model: SpikingNetwork, plan: StepBudget, device: torch.device, world: int) -> nn.Module:
    """The module that computes the training forward: ``model``, a checkpointed view of it, and
    under DDP its wrapper (all sharing ``model``'s parameters)."""
    runner: nn.Module = model if plan.mode is None else checkpointed(model, plan.mode)
    runner.train()
    if world > 1:
        ddp_kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
        runner = nn.parallel.DistributedDataParallel(runner, **ddp_kwargs)
    return runner


def _backward(runner: Any, x: torch.Tensor, y: torch.Tensor, soft: torch.Tensor | None,
              cfg: FinetuneConfig, micro: int, scaler, use_amp: bool, amp_dtype) -> tuple[float, torch.Tensor]:
    """The gradient of the batch's loss, in pieces of ``micro`` images whose losses (weighted by
    their share of the batch) add up to it; returns the loss and the readout."""
    pieces = list(zip(x.split(micro), y.split(micro),
                      soft.split(micro) if soft is not None else [None] * -(-len(x) // micro)))
    total, outs = 0.0, []
    loss: Any
    for i, (xp, yp, sp) in enumerate(pieces):
        last = i == len(pieces) - 1
        sync = contextlib.nullcontext() if last or not hasattr(runner, "no_sync") else runner.no_sync()
        with sync:
            with torch.autocast(xp.device.type, dtype=amp_dtype, enabled=use_amp):
                if cfg.horizons or cfg.per_step:
                    steps = runner(xp, per_step=True).float()
                    cum = steps.cumsum(0)
                    out = cum[-1] / cfg.T
                    # anytime readout: cross-entropy of the running average after each horizon
                    loss = _horizons_loss(cum, yp, sp, cfg) if cfg.horizons else _readout_loss(out, yp, sp, cfg)
                    if cfg.per_step:
                        each = sum(_readout_loss(o, yp, sp, cfg) for o in steps) / len(steps)
                        loss = (1 - cfg.per_step) * loss + cfg.per_step * each
                else:
                    out = runner(xp)
                    loss = _readout_loss(out.float(), yp, sp, cfg)
            if len(pieces) > 1:
                loss = loss * (len(xp) / len(x))
            scaler.scale(loss).backward()
        total += loss.item()
        outs.append(out.detach())
    return total, outs[0] if len(outs) == 1 else torch.cat(outs)


def _horizons_loss(cum: torch.Tensor, y: torch.Tensor, soft: torch.Tensor | None, cfg: FinetuneConfig):
    """The anytime readouts' loss: the cross-entropy of the running average after each horizon,
    their mean (or their ``horizon_weights``' weighted mean)."""
    terms = [_readout_loss(cum[h - 1] / h, y, soft, cfg) for h in cfg.horizons or ()]
    if cfg.horizon_weights is None:
        return sum(terms) / len(terms)
    return sum(w * t for w, t in zip(cfg.horizon_weight().values(), terms))


def _val_accuracy(model: SpikingNetwork, val: Iterable, cfg: FinetuneConfig, device) -> float:
    """Validation accuracy: the mean over the trained readouts (one run), else at ``model.T``."""
    if cfg.horizons:
        acc = accuracy_by_T(model, val, cfg.horizons, device)
        if cfg.horizon_weights is None:
            return sum(acc.values()) / len(cfg.horizons)
        return sum(w * acc[h] for h, w in cfg.horizon_weight().items())
    return evaluate(model, val, device)


def start_margin(accuracy: float, n: int) -> float:
    """``keep_start``'s handicap: one binomial standard error (points) of a validation
    ``accuracy`` (percent) measured on ``n`` samples."""
    p = min(max(accuracy / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1.0 - p) / max(1, n))


def _val_size(val: Iterable) -> int:
    """Samples in a validation split (a DataLoader over a dataset, or a list of batches,
    possibly wrapped in :class:`TeacherLabelled`)."""
    inner = getattr(val, "loader", val)
    dataset = getattr(inner, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(len(split_batch(b, where="the validation split")[0]) for b in inner)


def blend(start: SpikingNetwork, tuned: SpikingNetwork, wise: float) -> SpikingNetwork:
    """A copy of ``tuned`` with weights ``(1 - wise) * tuned + wise * start`` (WiSE-FT).

    Both must be the same network (same parameter names and shapes); thresholds blend too and
    stay positive. Integer buffers are taken from ``tuned``.
    """
    for name, net in (("start", start), ("tuned", tuned)):
        if not isinstance(net, SpikingNetwork):
            raise StageOrderError(f"blend() expects SpikingNetworks; {name} is a {type(net).__name__}")
    a, b = start.state_dict(), tuned.state_dict()
    shapes_a = {k: tuple(v.shape) for k, v in a.items()}
    shapes_b = {k: tuple(v.shape) for k, v in b.items()}
    if shapes_a != shapes_b:
        diff = sorted(set(shapes_a.items()) ^ set(shapes_b.items()))[:3]
        raise ConfigError(f"blend() needs two versions of the same network; their parameters "
                         f"differ, e.g. {diff} (name, shape)")
    if not 0 <= wise <= 1:
        raise ConfigError(f"wise must be in [0, 1], got {wise}")
    out = copy.deepcopy(tuned)
    out.load_state_dict({k: torch.lerp(v, a[k].to(v), wise) if v.is_floating_point() else v
                         for k, v in b.items()})
    return out


@dataclass
class _Run:
    """One fine-tuning run's state. ``model`` owns the parameters (state dicts, checkpoints,
    evaluation); ``runner`` computes the training forward (a checkpointed view and/or a DDP
    wrapper sharing those parameters), made at the first step, whose images say what fits
    (:func:`plan_step`). ``best_state``: the weights of the best validation score so far."""

    cfg: FinetuneConfig
    model: SpikingNetwork
    thresholds: list[nn.Parameter]
    teacher: nn.Module | None
    data: TrainingData
    label_free: bool
    steps_per_epoch: int | None
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    use_amp: bool
    amp_dtype: torch.dtype
    device: torch.device
    rank: int
    world: int
    ckpt_path: str | None
    fingerprint: str
    start_digest: str
    data_size: int | None
    runner: nn.Module | None = None
    plan: StepBudget | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    best_val: float = -1.0
    best_state: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class _Resume:
    """Where a run starts: the epoch and step, and for a mid-epoch resume the RNG state to set
    once the epoch's first ``step`` batches are passed and the loss sums so far (rank 0)."""

    epoch: int = 0
    step: int = 0
    rng: Any = None
    partial: list[float] | None = None


def _finetune(snn, loader, cfg: FinetuneConfig, teacher, device, progress, rank, world):
    """:func:`finetune` once its arguments are checked: trains a copy of ``snn`` and returns it
    with the history."""
    from snnconv.analysis.plots import plot_history

    run = _start(snn, loader, cfg, teacher, device, rank, world)
    at = _resume(run) if cfg.resume and run.ckpt_path and os.path.exists(run.ckpt_path) else _Resume()
    start_val: float | None = None
    margin = 0.0
    if cfg.keep_start and run.data.val is not None and at.epoch == 0 and at.step == 0:
        # the converted network is epoch 0, handicapped by one standard error of its score: a
        # trained epoch wins a tie within the split's noise, a worse one loses to the start
        run.model.eval()
        start_val = _val_accuracy(run.model, run.data.val, cfg, device)
        margin = start_margin(start_val, _val_size(run.data.val))
        run.best_val, run.best_state = start_val - margin, copy.deepcopy(run.model.state_dict())
    for epoch in range(at.epoch, cfg.epochs):
        record = _train_epoch(run, epoch, at.step if epoch == at.epoch else 0, at, progress)
        if run.data.val is not None:
            record["val_acc"] = _val_accuracy(run.model, run.data.val, cfg, device)
            if record["val_acc"] > run.best_val:
                run.best_val = record["val_acc"]
                run.best_state = copy.deepcopy(run.model.state_dict())
        run.history.append(record)
        _save(run, epoch + 1, 0)
        if run.ckpt_path and rank == 0:
            assert cfg.checkpoint_dir is not None  # where ckpt_path lives
            plot_history(run.history, os.path.join(cfg.checkpoint_dir, "training_curve.png"))
    if start_val is not None and run.history:
        run.history[-1]["start_val_acc"] = start_val
        run.history[-1]["start_margin"] = margin
        # the best only moves on a strict improvement: still equal, no epoch beat the start
        run.history[-1]["kept_start"] = run.best_val == start_val - margin
    return _finish(run, snn), run.history


def _start(snn: SpikingNetwork, loader: Iterable, cfg: FinetuneConfig, teacher: nn.Module | None,
           device: torch.device, rank: int, world: int) -> _Run:
    """A run at its start: a trainable copy of ``snn`` at ``cfg.T``, the data, the optimiser and
    its schedule, the gradient scaler and the checkpoint's identity."""
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(snn).to(device)
    model.T = cfg.T
    if teacher is not None:
        teacher = copy.deepcopy(teacher).to(device).eval().requires_grad_(False)
    for m in neurons(model).values():
        m.set_surrogate(alpha=cfg.alpha, detach_reset=cfg.detach_reset)
        m.theta.requires_grad_(cfg.train_thresholds)
    thresholds = [m.theta for m in neurons(model).values()] if cfg.train_thresholds else []
    data = training_data(loader, cfg, rank, world)
    label_free = teacher is not None and cfg.distill == 1
    if label_free and data.val is not None:
        data.val = TeacherLabelled(data.val, teacher, device)
    steps_per_epoch = len(data.train) if isinstance(data.train, Sized) else None
    if steps_per_epoch == 0:
        raise DataError("the fine-tuning loader yields no full batch after the validation split")
    if cfg.max_steps_per_epoch and steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    opt = make_optimizer(model, cfg.optimizer, cfg.lr, weight_decay=cfg.weight_decay,
                         momentum=cfg.momentum, threshold_lr=cfg.threshold_lr,
                         threshold_params=thresholds)
    # an unsized loader has no known length to anneal over: constant rate after warm-up
    total = cfg.epochs * steps_per_epoch if steps_per_epoch else 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, cfg.warmup_steps))
    use_amp = cfg.amp and device.type == "cuda"
    amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    ckpt_path = os.path.join(cfg.checkpoint_dir, CHECKPOINT_NAME) if cfg.checkpoint_dir else None
    return _Run(cfg, model, thresholds, teacher, data, label_free, steps_per_epoch, opt, sched, scaler,
                use_amp, amp_dtype, device, rank, world, ckpt_path, _fingerprint(model),
                _weights_digest(model) if ckpt_path else "", training_size(data))


def _resume(run: _Run) -> _Resume:
    """Load the run's checkpoint into ``run`` (weights, optimiser, schedule, scaler, RNG,
    history, best so far); where it starts again."""
    path = run.ckpt_path
    assert path is not None  # resumed only from a checkpoint file
    state = read_checkpoint(path)
    check_checkpoint(path, state, run.model, run.cfg.epochs, run.steps_per_epoch)
    _check_resumable(path, state, run.fingerprint, run.cfg, run.data.global_batch, run.start_digest,
                     run.data_size)
    try:
        run.model.load_state_dict(state["model"])
        run.opt.load_state_dict(state["optimizer"])
        run.sched.load_state_dict(state["scheduler"])
        run.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], run.device)  # an epoch-end checkpoint continues from here
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its training state does not fit this run "
                              f"({type(exc).__name__}: {str(exc)[:200]}); delete it to start over") from None
    run.history = list(state["history"])
    run.best_val, run.best_state = state["best_val"], state["best_state"]
    if not state["step"]:
        return _Resume(state["epoch"])
    # mid-epoch: replaying the epoch's first batches may draw random numbers (dataset
    # transforms), so the state is set again once they are passed; the sums so far are
    # global (all ranks): rank 0 carries them, the others restart
    return _Resume(state["epoch"], state["step"], state["rng"], state["partial"] if run.rank == 0 else None)


def _save(run: _Run, epoch: int, step: int, partial: list[float] | None = None) -> None:
    """Write the run's checkpoint (rank 0, where the run has a checkpoint file)."""
    if run.ckpt_path is None or run.rank != 0:
        return
    write_checkpoint(run.ckpt_path, {
        "fingerprint": run.fingerprint, "start_digest": run.start_digest, "data_size": run.data_size,
        "config": asdict(run.cfg), "global_batch": run.data.global_batch,
        "epoch": epoch, "step": step, "partial": partial,
        "model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
        "scheduler": run.sched.state_dict(), "scaler": run.scaler.state_dict(),
        "rng": rng_state(run.device), "history": run.history, "best_val": run.best_val,
        "best_state": run.best_state})


def _train_epoch(run: _Run, epoch: int, skip: int, at: _Resume, progress: bool) -> dict[str, float]:
    """Train one epoch (its first ``skip`` batches passed over on a mid-epoch resume); its
    record: loss, training accuracy, steps and seconds."""
    cfg, device = run.cfg, run.device
    run.data.start_epoch(epoch, cfg.seed)
    run.model.train()
    if run.runner is not None:
        run.runner.train()
    t0 = time.perf_counter()
    sums = torch.zeros(3, dtype=torch.float64)  # loss*n, correct, n
    if skip and at.partial is not None:
        sums = torch.tensor(at.partial, dtype=torch.float64)
    bar = progress_bar(total=run.steps_per_epoch, initial=skip, desc=f"BPTT epoch {epoch + 1}/{cfg.epochs}",
                       disable=not progress, leave=False)
    batches = iter(bounded(run.data.train, where="the fine-tuning loader"))
    if cfg.max_steps_per_epoch:
        batches = itertools.islice(batches, cfg.max_steps_per_epoch)
    seen = 0
    same = SameShape("the fine-tuning loader")
    for step, batch in enumerate(batches):
        seen = step + 1
        if step < skip:
            if step == skip - 1:
                assert at.rng is not None  # skip > 0 only on a mid-epoch resume
                set_rng_state(at.rng, device)
            continue
        loss, out, y = _train_step(run, batch, step, same)
        with torch.no_grad():
            sums += torch.tensor([loss * len(y), (out.argmax(1) == y).sum().item(), len(y)],
                                 dtype=torch.float64)
        bar.update(1)
        bar.set_postfix(loss=f"{sums[0] / sums[2]:.3f}", acc=f"{100 * sums[1] / sums[2]:.1f}")
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            partial = all_reduce_sum(sums, device) if run.world > 1 else sums
            _save(run, epoch, step + 1, partial.tolist())
    bar.close()
    if seen < skip:
        raise CheckpointError(
            f"{run.ckpt_path} stopped after step {skip} of epoch {epoch + 1}, but the loader now "
            f"yields only {seen} batches per epoch; resume with the same data")
    if run.world > 1:
        sums = all_reduce_sum(sums, device)
    if sums[2] == 0:
        raise DataError(
            f"the fine-tuning loader yielded no batch in epoch {epoch + 1}; a one-shot iterator "
            "(a generator) can be read only once: pass a DataLoader or a list of batches")
    return {"epoch": epoch + 1, "loss": float(sums[0] / sums[2]),
            "train_acc": float(100 * sums[1] / sums[2]), "steps": seen,
            "seconds": time.perf_counter() - t0}


def _train_step(run: _Run, batch: Any, step: int, same: SameShape
                ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One optimiser step on ``batch``: its loss, the readout and the labels it was scored on."""
    cfg = run.cfg
    x, y = split_batch(batch, where="fine-tuning loader")
    same(x, step)
    if y is None and not run.label_free:
        raise DataError("fine-tuning needs labels, but the loader yields inputs only; pass "
                        "(x, y) batches, or distill=1.0 with a teacher to learn from its "
                        "outputs alone")
    x = x.to(run.device)
    soft, y = teacher_targets(run.teacher, x, y, cfg.distill_temperature, run.device)
    if run.runner is None:
        run.plan = _step_plan(run.model, x, cfg, run.device, run.world)
        run.runner = _runner(run.model, run.plan, run.device, run.world)
    assert run.plan is not None  # made with the runner
    run.opt.zero_grad(set_to_none=True)
    loss, out = _backward(run.runner, x, y, soft, cfg, run.plan.micro_batch, run.scaler, run.use_amp,
                          run.amp_dtype)
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.opt)
        nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.scaler.step(run.opt)
    run.scaler.update()
    run.sched.step()
    if run.thresholds:
        with torch.no_grad():
            for m in neurons(run.model).values():
                m.theta.clamp_(min=1e-3)
    return loss, out, y


def _finish(run: _Run, snn: SpikingNetwork) -> SpikingNetwork:
    """The trained network: the best weights (blended with ``snn``'s for ``wise``), in eval
    mode, thresholds frozen, at ``snn``'s T."""
    model = run.model
    if run.best_state is not None:
        model.load_state_dict(run.best_state)
    if run.cfg.wise:
        model = blend(snn, model, run.cfg.wise)
    model.eval()
    if run.plan is not None:
        model.meta["finetune_step"] = run.plan.to_dict()
    for m in neurons(model).values():
        m.theta.requires_grad_(False)
    model.T = snn.T
    return model
