"""The `qcfs` stage: QCFS threshold calibration.

Every ReLU call site becomes its own ``QCFS(L, lambda)`` (Bu et al., ICLR 2022)::

    a = lambda * clip(floor(z * L / lambda + phi) / L, 0, 1),   phi = 1/2

with lambda initialised from a percentile of the site's pre-activation on calibration data,
then optionally trained together with the weights (QCFS-aware ANN training).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, Callable, Iterable, cast

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.data import DataLoader

from snnconv.activation import (
    QCFS,
    check_activations,
    hard_reset_rate,
    is_inplace,
    qcfs_sites,
    relu_input,
    relu_sites,
    replace_maxpool,
)
from snnconv.analysis.metrics import TeacherLabelled, distillation_loss, evaluate, teacher_targets
from snnconv.data import SameShape, bounded, calibration_batches, split_batch, split_loader
from snnconv.errors import ConfigError, DataError
from snnconv.graph import capture_pieces, describe_node, module_of, prepare
from snnconv.guards import assert_no_batchnorm
from snnconv.progress import progress_bar

__all__ = ["calibrate_qcfs", "QCFSTrainConfig", "make_optimizer"]

def _site_name(node: fx.Node, used: set[str]) -> str:
    name, k = f"qcfs_{node.name}", 1
    while name in used:
        name, k = f"qcfs_{node.name}_{k}", k + 1
    used.add(name)
    return name


def _percentiles(gm: fx.GraphModule, loader: Iterable, sites: list[fx.Node], *, percentile: float,
                 per_channel: bool, num_batches: int, device: torch.device,
                 progress: bool, max_samples: int = 1 << 18,
                 ndims: dict[str, int] | None = None, hard_T: int | None = None) -> dict[str, torch.Tensor]:
    """Per site, lambda: the ``percentile`` of its pre-activation (with ``hard_T``, then
    :func:`_fit_hard_lambda`)."""
    inputs = {s.name: relu_input(s).name for s in sites}
    samples: dict[str, list[torch.Tensor]] = {s.name: [] for s in sites}
    gen = torch.Generator().manual_seed(0)
    seen = 0
    bar = progress_bar(total=num_batches, desc="calibrate", disable=not progress, leave=False)
    same = SameShape("the calibration loader")
    for i, batch in enumerate(loader):
        if i >= num_batches:
            break
        x = same(split_batch(batch, where="calibration loader")[0], i)
        _check_finite(x, f"calibration batch {i}")
        x = x.to(device)
        # in pieces of images where the batch's values do not fit, each sampled in proportion
        for lo, hi, values in capture_pieces(gm, x, set(inputs.values())):
            cap = max(1, max_samples * (hi - lo) // len(x))
            for site, src in inputs.items():
                # samples stay on the calibration device (the quantiles run there: on a GPU, much
                # faster than on one CPU thread); the subsampling indices come from a CPU generator
                v = values[src].detach().float()
                if ndims is not None:
                    ndims[site] = v.dim()
                if per_channel:
                    v = v.transpose(0, 1).reshape(v.shape[1], -1)
                    if v.shape[1] > cap // max(1, v.shape[0]) * 4:
                        keep = torch.randperm(v.shape[1], generator=gen)[: max(1, cap // v.shape[0]) * 4]
                        v = v[:, keep.to(v.device)]
                else:
                    v = v.reshape(-1)
                    if v.numel() > cap:
                        v = v[torch.randperm(v.numel(), generator=gen)[:cap].to(v.device)]
                samples[site].append(v)
            del values
        seen += 1
        bar.update(1)
    bar.close()
    if seen == 0:
        raise DataError("the calibration loader is empty: it yielded no batch. QCFS thresholds "
                        "are set from data; pass a loader with at least one batch.")
    q = percentile / 100.0
    out = {}
    for site, chunks in samples.items():
        if per_channel:
            v = torch.cat(chunks, dim=1)
            lam = torch.quantile(v, q, dim=1) if v.shape[1] <= 16_000_000 else v.max(dim=1).values
        else:
            v = torch.cat(chunks)
            lam = torch.quantile(v[: 16_000_000], q)
        if hard_T is not None:
            lam = _fit_hard_lambda(v if per_channel else v.reshape(1, -1), lam.reshape(-1), hard_T).reshape(lam.shape)
        out[site] = lam.clamp_min(1e-3)
    return out


#: The factors of the percentile that :func:`_fit_hard_lambda` tries: 2 ** (-k / 4), k = 0..16.
HARD_LAMBDA_FACTORS = tuple(2.0 ** (-k / 4) for k in range(17))


def _fit_hard_lambda(v: torch.Tensor, lam: torch.Tensor, T: int) -> torch.Tensor:
    """Per row of ``v`` (``[C, n]`` samples of a site's pre-activation), the threshold among
    ``lam * HARD_LAMBDA_FACTORS`` whose hard-reset rate over ``T`` steps
    (:func:`~snnconv.activation.hard_reset_rate`, output lambda per spike) is nearest the ReLU
    in mean square: the staircase's few levels (1, 1/2, 1/3, ... of lambda) sit where the
    values are, not at the percentile."""
    v = v[:, : 1 << 16].float()
    relu = v.clamp_min(0)
    best, err = lam.clone(), torch.full_like(lam, math.inf)
    for f in HARD_LAMBDA_FACTORS:
        cand = (lam * f).clamp_min(1e-3)
        e = ((cand[:, None] * hard_reset_rate(v / cand[:, None], T) - relu) ** 2).mean(dim=1)
        better = e < err
        best, err = torch.where(better, cand, best), torch.where(better, e, err)
    return best


def _check_finite(x: torch.Tensor, where: str) -> None:
    if x.is_floating_point() and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise DataError(f"{where} holds {bad} NaN/inf value(s); clean the data before converting")


@dataclass(frozen=True)
class QCFSTrainConfig:
    """QCFS-aware ANN training settings (validated on construction).

    ``max_steps`` bounds the optimiser steps over all epochs (None: every batch of every epoch);
    the cosine schedule spans the steps that run, and the epoch it ends in is validated.
    ``distill`` in [0, 1] mixes distillation from a teacher (``calibrate_qcfs(teacher=)``, the
    ANN before QCFS) into the loss, as in fine-tuning (:func:`snnconv.analysis.metrics.distillation_loss`
    at ``distill_temperature``); at 1 the loader needs no labels and the validation split
    scores agreement with the teacher. The temperature is 1 by default: the distillation term
    is scaled by its square, and SGD at a higher one diverged on a BatchNorm-free network (the
    measurements: ``benchmarks/studies/README.md``, ``qcfs_distill``).

    ``noise`` > 0: noise-modelled QCFS training (Hu et al., arXiv 2404.17456). Before each epoch
    the converted network's residual error at every site is measured on ``noise_batches``
    batches of the validation split (``calibrate_qcfs(noise_model=)``, which
    :func:`snnconv.convert` passes at its T and reset), and in training each QCFS output loses
    ``noise * sigma * N(0, 1)`` with that site's standard deviation ``sigma`` (``noise=1``:
    the measured deviation itself, as the reference injects it): the weights learn to tolerate
    the error the spikes will make. The reference trains from scratch with sigma 0
    in its first epoch; here the calibrated network already has a spiking counterpart, so the
    first epoch has its noise too. ``meta["qcfs"]["history"]`` records each epoch's sigmas."""

    epochs: int = 0
    optimizer: str = "sgd"
    lr: float = 0.01
    lambda_lr: float | None = None
    weight_decay: float = 5e-4
    momentum: float = 0.9
    label_smoothing: float = 0.0
    val_fraction: float = 0.1
    seed: int = 0
    max_steps: int | None = None
    distill: float = 0.0
    distill_temperature: float = 1.0
    noise: float = 0.0
    noise_batches: int = 4

    def __post_init__(self):
        if isinstance(self.noise, bool) or not 0 <= float(self.noise) < math.inf:
            raise ConfigError(f"noise must be a finite number >= 0 (1: the measured residual error), "
                              f"got {self.noise!r}")
        if isinstance(self.noise_batches, bool) or int(self.noise_batches) != self.noise_batches \
                or self.noise_batches < 1:
            raise ConfigError(f"noise_batches must be an integer >= 1, got {self.noise_batches!r}")
        if not 0 <= self.distill <= 1:
            raise ConfigError(f"distill must be in [0, 1], got {self.distill}")
        if self.distill_temperature <= 0:
            raise ConfigError(f"distill_temperature must be positive, got {self.distill_temperature}")
        if self.epochs < 0 or int(self.epochs) != self.epochs:
            raise ConfigError(f"epochs must be a non-negative integer, got {self.epochs}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or int(self.max_steps) != self.max_steps
                                           or self.max_steps < 1):
            raise ConfigError(f"max_steps must be None or an integer >= 1, got {self.max_steps!r}")
        if self.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.lr <= 0 or (self.lambda_lr is not None and self.lambda_lr <= 0):
            raise ConfigError(f"learning rates must be positive, got lr={self.lr}, lambda_lr={self.lambda_lr}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")


def make_optimizer(model: nn.Module, name: str, lr: float, *, weight_decay: float,
                   momentum: float = 0.9, threshold_lr: float | None = None,
                   threshold_params: Iterable[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW; weight decay only on weight tensors, never on thresholds/biases."""
    thresholds = {id(p) for p in threshold_params}
    decay, no_decay, thr = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in thresholds:
            thr.append(p)
        elif p.dim() > 1:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if thr:
        groups.append({"params": thr, "weight_decay": 0.0, "lr": threshold_lr or lr})
    groups = [g for g in groups if g["params"]]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)
    return torch.optim.AdamW(groups, lr=lr)


_NEEDS_LABELS = ("QCFS training needs labels, but the loader yields inputs only. Pass a loader of "
                 "(x, y) batches, distill=1.0 with a teacher to learn from its outputs alone, or "
                 "qcfs_epochs=0 to calibrate only.")


def set_noise(gm: fx.GraphModule, sigmas: dict[str, float]) -> dict[str, float]:
    """Set each QCFS module's ``noise`` to the sigma of its call site in ``sigmas`` (fx node
    name -> sigma; a module called at several sites takes their largest, one absent 0);
    returns module target -> sigma."""
    by_module = {str(n.target): 0.0 for n in gm.graph.nodes
                 if n.op == "call_module" and isinstance(module_of(gm, n), QCFS)}
    for node in gm.graph.nodes:
        if node.name in sigmas and str(node.target) in by_module:
            by_module[str(node.target)] = max(by_module[str(node.target)], float(sigmas[node.name]))
    for target, sigma in by_module.items():
        cast(QCFS, gm.get_submodule(target)).noise = sigma
    return by_module


def _train_qcfs(gm: fx.GraphModule, loader: Iterable, cfg: QCFSTrainConfig, device: torch.device,
                progress: bool, summary: dict[str, Any], teacher: nn.Module | None,
                noise_model: Callable[..., dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Train weights and lambdas; keep the best epoch on the validation split, where the
    calibrated state counts as epoch 0 (``summary`` gets ``calibrated_val_acc`` and ``best_epoch``)."""
    # a list of one batch holds nothing out: train on it without best-epoch selection
    one_batch = not isinstance(loader, DataLoader) and _length(loader) == 1
    train, val = split_loader(loader, 0.0 if one_batch else cfg.val_fraction, seed=cfg.seed)
    if val is not None and isinstance(val, Sized) and len(val) == 0:
        val = None
    probe = ([x.to(device) for x in calibration_batches(val if val is not None else train, cfg.noise_batches,
                                                         "QCFS training's validation split")]
             if noise_model is not None else [])
    label_free = teacher is not None and cfg.distill == 1
    if val is not None:
        val = TeacherLabelled(val, teacher if label_free else None, device, missing=_NEEDS_LABELS)
    lams = [m.lam for m in qcfs_sites(gm).values()]
    opt = make_optimizer(gm, cfg.optimizer, cfg.lr, weight_decay=cfg.weight_decay,
                         momentum=cfg.momentum, threshold_lr=cfg.lambda_lr, threshold_params=lams)
    steps = cfg.epochs * max(1, len(train)) if isinstance(train, Sized) else None
    if cfg.max_steps is not None:
        steps = cfg.max_steps if steps is None else min(steps, cfg.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) if steps else 1.0)
    history = []
    best: tuple[float, dict[str, Any] | None] = (-1.0, None)
    if val is not None:
        # the calibrated, untrained state is epoch 0: training can never return something worse
        gm.eval()
        best = (evaluate(gm, val, device), copy.deepcopy(gm.state_dict()))
        summary["calibrated_val_acc"] = best[0]
    best_epoch = 0
    total = 0
    torch.manual_seed(cfg.seed)
    for epoch in range(cfg.epochs):
        if cfg.max_steps is not None and total >= cfg.max_steps:
            break
        sigmas = None
        if noise_model is not None and probe:
            with torch.random.fork_rng(devices=[]):
                sigmas = set_noise(gm, {k: cfg.noise * v for k, v in noise_model(gm, probe).items()})
        gm.train()
        loss_sum, n, correct = 0.0, 0, 0
        length = _length(train)
        if length is not None and cfg.max_steps is not None:
            length = min(length, cfg.max_steps - total)  # the last epoch is cut
        bar = progress_bar(bounded(train, where="the QCFS training loader"), total=length,
                           desc=f"QCFS epoch {epoch + 1}/{cfg.epochs}", disable=not progress, leave=False)
        steps_done = 0
        same = SameShape("the QCFS training loader")
        for batch in bar:
            steps_done += 1
            total += 1
            x, y = split_batch(batch, where="training loader")
            same(x, steps_done - 1)
            if y is None and not label_free:
                raise DataError(_NEEDS_LABELS)
            x = x.to(device)
            soft, y = teacher_targets(teacher, x, y, cfg.distill_temperature, device)
            out = gm(x)
            loss = distillation_loss(out, y, soft, weight=cfg.distill, temperature=cfg.distill_temperature,
                                     label_smoothing=cfg.label_smoothing, where="the QCFS training loader")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                for lam in lams:
                    lam.clamp_(min=1e-3)
            loss_sum += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
            bar.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{100 * correct / n:.1f}")
            if cfg.max_steps is not None and total >= cfg.max_steps:
                break
        gm.eval()
        record: dict[str, Any] = {"epoch": epoch + 1, "loss": loss_sum / max(n, 1),
                                  "train_acc": 100.0 * correct / max(n, 1), "steps": steps_done}
        if sigmas is not None:
            record["noise"] = sigmas
        if val is not None:
            record["val_acc"] = evaluate(gm, val, device)
            if record["val_acc"] > best[0]:
                best = (record["val_acc"], copy.deepcopy(gm.state_dict()))
                best_epoch = epoch + 1
        history.append(record)
    set_noise(gm, {})
    if best[1] is not None:
        gm.load_state_dict(best[1])
        summary["best_epoch"] = best_epoch
        if best_epoch == 0 and history:
            warnings.warn(
                f"QCFS training did not beat the calibrated network on the validation split in "
                f"{len(history)} epoch(s) ({best[0]:.1f}% at the start, {history[-1]['val_acc']:.1f}% "
                "after the last): the calibrated network is kept. Far below the start means the "
                "training diverged: lower QCFSTrainConfig.lr (or distill_temperature), or pass "
                "qcfs_epochs=0.", RuntimeWarning, stacklevel=3)
    gm.eval()
    return history


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def calibrate_qcfs(
    model: nn.Module,
    loader: Iterable,
    *,
    L: int = 8,
    percentile: float = 99.9,
    per_channel: bool = False,
    num_batches: int = 10,
    maxpool: str = "error",
    train: QCFSTrainConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    teacher: nn.Module | None = None,
    noise_model: Callable[..., dict[str, float]] | None = None,
    hard_T: int | None = None,
) -> fx.GraphModule:
    """Replace every ReLU call site of a BatchNorm-free ``model`` with its own calibrated QCFS.

    lambda starts at the ``percentile`` of each site's pre-activation over ``num_batches`` batches
    (per layer, or per channel), then ``train`` optionally runs QCFS-aware training (labels
    needed unless ``train.distill`` is 1; validation split from ``loader``). ``teacher`` (an ANN
    mapping the same inputs to the same classes, used on a copy in eval mode) is required
    exactly when ``train.distill > 0``. ``noise_model(gm, batches)`` (required exactly when
    ``train.noise > 0``; :func:`snnconv.calibration.noise.residual_noise` at the target T) gives
    each QCFS call site's noise sigma before each epoch. ``hard_T``: every new site computes the
    rate of a reset-to-zero IF neuron over that many steps instead (:class:`QCFS` ``hard_T``),
    in training too. Works on a copy; returns a GraphModule whose
    ``meta["qcfs"]`` records lambda per site and the training history.

    Raises:
        BatchNormRemainsError: the model still holds BatchNorm (fold it first).
        UnsupportedLayerError: another activation (GELU, SiLU, ...), or max-pooling without
            ``maxpool="avg"``.
        DataError: empty loader, NaN/inf data, or training without labels (and ``distill < 1``).
        ConfigError: a teacher without ``train.distill > 0``, or the other way round.
    """
    distill = train.distill if train is not None and train.epochs > 0 else 0.0
    if (teacher is None) != (distill == 0):
        raise ConfigError("QCFS distillation needs both a teacher and train.distill > 0 (with epochs >= 1); "
                          f"got teacher={type(teacher).__name__ if teacher is not None else None} "
                          f"and distill={distill}")
    noisy = train is not None and train.epochs > 0 and train.noise > 0
    if noisy != (noise_model is not None):
        raise ConfigError("noise-modelled QCFS training needs both train.noise > 0 (with epochs >= 1) "
                          "and a noise_model (the spiking network's residual error per site; "
                          "snnconv.convert passes it)")
    if teacher is not None and not isinstance(teacher, nn.Module):
        raise ConfigError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
    if maxpool not in ("error", "avg"):
        raise ConfigError(f"maxpool must be 'error' or 'avg', got {maxpool!r}")
    if not 0 < percentile <= 100:
        raise ConfigError(f"percentile must be in (0, 100], got {percentile}")
    if isinstance(L, bool) or int(L) != L or L < 1:
        raise ConfigError(f"L (QCFS quantisation levels) must be an integer >= 1, got {L!r}")
    if isinstance(num_batches, bool) or int(num_batches) != num_batches or num_batches < 1:
        raise ConfigError(f"num_batches must be an integer >= 1, got {num_batches!r}")
    device = torch.device(device)
    gm = prepare(model, leaf_types=(QCFS,))
    assert_no_batchnorm(gm, stage="before QCFS calibration")
    check_activations(gm, maxpool)
    pooled = replace_maxpool(gm) if maxpool == "avg" else []
    gm.recompile()
    gm.to(device)
    sites = relu_sites(gm)
    ndims: dict[str, int] = {}
    lams = _percentiles(gm, loader, sites, percentile=percentile, per_channel=per_channel,
                        num_batches=num_batches, device=device, progress=progress, ndims=ndims, hard_T=hard_T)
    used: set[str] = set(n for n, _ in gm.named_modules())
    record: dict[str, Any] = {"sites": {}, "maxpool_replaced": pooled, "hard_T": hard_T}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sites:
        name = _site_name(node, used)
        src = relu_input(node)
        inplace = is_inplace(gm, node)
        cap = getattr(module_of(gm, node), "cap", None)  # a clipped ReLU (snnconv.constructs.clip)
        if cap is not None:
            lams[node.name] = lams[node.name].clamp(max=cap)
        site = QCFS(L, lams[node.name], hard_T=hard_T).to(device)
        # the rank of the site's input (not saved): IF replacement needs it to scale a Linear
        # that reads this site's output on the right dimension
        site.input_ndim = ndims.get(node.name)  # type: ignore[assignment]  # a plain attribute
        gm.add_submodule(name, site)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, (src,))
        node.replace_all_uses_with(new)
        if inplace and isinstance(src, fx.Node):
            # an in-place ReLU also rewrote its input: later readers of it saw the activation
            for user in list(src.users):
                if user is not new and order.get(user, -1) > order[node]:
                    user.replace_input_with(src, new)
        gm.graph.erase_node(node)
        record["sites"][name] = {"replaces": describe_node(node), "lambda_init": lams[node.name].tolist()}
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    if train is not None and train.epochs > 0:
        if teacher is not None:
            teacher = copy.deepcopy(teacher).to(device).eval().requires_grad_(False)
        record["history"] = _train_qcfs(gm, loader, train, device, progress, record, teacher, noise_model)
    for name, q in qcfs_sites(gm).items():
        site = record["sites"].setdefault(name, {"replaces": "an existing QCFS module (kept)"})
        site["lambda"] = q.lam.detach().cpu().tolist()
    gm.meta["qcfs"] = record
    return gm
