"""Accuracy and agreement measures shared by the stages, the demo and the benchmarks, and the
distillation loss both training stages (QCFS training, fine-tuning) learn from a teacher with.

Evaluation never touches the global RNG: it runs under ``torch.random.fork_rng`` (creating a
DataLoader iterator draws a worker base seed from the global generator even with
``shuffle=False``), so evaluating between two training stages cannot change what they train on.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from snnconv.data import SameShape, bounded, check_labels, split_batch
from snnconv.errors import DataError

__all__ = ["evaluate", "predictions", "accuracy_by_T", "distillation_loss", "TeacherLabelled", "teacher_targets",
           "kl_to"]


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, without gradients or a draw from the global RNG; its mode restored."""
    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            yield
    finally:
        model.train(was)


def _labelled_batches(loader: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` of each batch of an evaluation loader; a batch without labels is refused."""
    same = SameShape("the evaluation loader")
    for i, batch in enumerate(bounded(loader, where="the evaluation loader")):
        x, y = split_batch(batch, where="evaluation loader")
        same(x, i)
        if y is None:
            raise DataError("evaluation needs labels: the loader yielded inputs only")
        yield x, y


def predictions(model: nn.Module, loader: Iterable, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Arg-max predictions and labels of ``model`` over a labelled loader."""
    preds, labels = [], []
    with _evaluating(model):
        for x, y in _labelled_batches(loader):
            out = model(x.to(device))
            check_labels(y, out.shape[1], where="the evaluation loader")
            preds.append(out.argmax(dim=1).cpu())
            labels.append(y.cpu())
    if not preds:
        raise DataError("the evaluation loader is empty: it yielded no batch")
    return torch.cat(preds), torch.cat(labels)


def kl_to(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per image, ``KL(softmax(reference) || softmax(logits))`` in float64: how far a network's
    outputs ``logits`` (``[B, classes]``) are from a reference's (the ANN's)."""
    p = F.log_softmax(reference.double(), dim=1)
    return (p.exp() * (p - F.log_softmax(logits.double(), dim=1))).sum(1)


def evaluate(model: nn.Module, loader: Iterable, device: torch.device | str = "cpu") -> float:
    """Top-1 accuracy (percent) of ``model`` on a labelled loader."""
    pred, y = predictions(model, loader, device)
    return 100.0 * (pred == y).float().mean().item()


def accuracy_by_T(snn: Any, loader: Iterable, Ts: Iterable[int],
                  device: torch.device | str = "cpu") -> dict[int, float]:
    """SNN top-1 accuracy at each T, computed from one run at max(T) (cumulative readouts).

    The readout averaged over the first t steps of a T-step run equals a t-step run, because
    the state starts fresh and the input is the same at every step.
    """
    Ts = sorted(set(int(t) for t in Ts))
    if not Ts:
        return {}
    T_max = Ts[-1]
    correct = {t: 0 for t in Ts}
    total = 0
    with _evaluating(snn):
        for x, y in _labelled_batches(loader):
            steps = snn.run(x.to(device), T=T_max).cpu()
            check_labels(y, steps.shape[-1], where="the evaluation loader")
            cum = steps.cumsum(0)
            for t in Ts:
                correct[t] += (cum[t - 1].argmax(1) == y.cpu()).sum().item()
            total += len(y)
    if total == 0:
        raise DataError("the evaluation loader is empty: it yielded no batch")
    return {t: 100.0 * c / total for t, c in correct.items()}


def teacher_targets(teacher: nn.Module | None, x: torch.Tensor, y: torch.Tensor | None,
                    temperature: float, device: torch.device | str
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The teacher's softened outputs at ``temperature`` (None without a teacher) and the labels
    on ``device``: ``y``, or the teacher's top-1 where the batch has none (the cross-entropy
    weight is then 0). No gradients reach the teacher."""
    if teacher is None:
        assert y is not None, "an unlabelled batch needs a teacher"
        return None, y.to(device)
    with torch.no_grad():
        logits = teacher(x).float()
    return F.softmax(logits / temperature, dim=1), (logits.argmax(1) if y is None else y).to(device)


def distillation_loss(logits: torch.Tensor, y: torch.Tensor, soft: torch.Tensor | None, *,
                      weight: float, temperature: float, label_smoothing: float = 0.0,
                      where: str) -> torch.Tensor:
    """``(1 - weight) * CE(logits, y) + weight * tau^2 * KL(soft || softmax(logits / tau))``.

    ``soft``: the teacher's softened outputs (:func:`teacher_targets`), or None for the
    cross-entropy alone. Without labels ``y`` is the teacher's top-1 and ``weight`` is 1: the
    cross-entropy term has weight 0 and the teacher's outputs are the only targets."""
    check_labels(y, logits.shape[1], where=where)
    ce = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    if soft is None:
        return ce
    kd = F.kl_div(F.log_softmax(logits / temperature, dim=1), soft, reduction="batchmean")
    return (1 - weight) * ce + weight * temperature * temperature * kd


class TeacherLabelled:
    """The batches of ``loader`` as ``(x, y)``, ``y`` the teacher's top-1 where a batch has no
    labels: the validation split of label-free distillation scores agreement with the teacher.
    Without a teacher an unlabelled batch raises ``DataError(missing)``."""

    def __init__(self, loader: Iterable, teacher: nn.Module | None, device: torch.device | str,
                 missing: str = "validation needs labels or a teacher"):
        self.loader, self.teacher, self.device, self.missing = loader, teacher, device, missing

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # a DataLoader, or any sized iterable

    def __iter__(self):
        for batch in self.loader:
            x, y = split_batch(batch, where="the validation split")
            if y is None:
                if self.teacher is None:
                    raise DataError(self.missing)
                with torch.no_grad():
                    y = self.teacher(x.to(self.device)).argmax(1).cpu()
            yield x, y
