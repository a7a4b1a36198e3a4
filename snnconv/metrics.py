"""Accuracy and agreement measures shared by the stages, the demo and the benchmarks.

Evaluation never touches the global RNG: it runs under ``torch.random.fork_rng`` (creating a
DataLoader iterator draws a worker base seed from the global generator even with
``shuffle=False``), so evaluating between two training stages cannot change what they train on.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from .data import bounded, check_labels, split_batch
from .errors import DataError

__all__ = ["evaluate", "predictions", "accuracy_by_T"]


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
    for batch in bounded(loader, where="the evaluation loader"):
        x, y = split_batch(batch, where="evaluation loader")
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


def evaluate(model: nn.Module, loader: Iterable, device: torch.device | str = "cpu") -> float:
    """Top-1 accuracy (percent) of ``model`` on a labelled loader."""
    pred, y = predictions(model, loader, device)
    return 100.0 * (pred == y).float().mean().item()


def accuracy_by_T(snn: nn.Module, loader: Iterable, Ts: Iterable[int],
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
