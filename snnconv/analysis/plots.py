"""Headless matplotlib plots: accuracy against T, training curves. Files are written atomically."""

from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from snnconv.io.atomic import atomic_write_bytes  # noqa: E402

__all__ = ["plot_accuracy_vs_T", "plot_history"]


def _save(fig, path: str | os.PathLike) -> None:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=120, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def plot_accuracy_vs_T(curves: Mapping[str, Mapping[Any, float]], path: str | os.PathLike, *,
                       references: Mapping[str, float] | None = None,
                       title: str = "SNN accuracy vs time steps") -> None:
    """One line per method (``{name: {T: accuracy}}``), dashed horizontal lines for references."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in curves.items():
        Ts = sorted(int(t) for t in points)
        ax.plot(Ts, [points[t] if t in points else points[str(t)] for t in Ts], marker="o", label=name)
    for i, (name, value) in enumerate((references or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{(i + len(curves)) % 10}", label=f"{name} ({value:.1f}%)")
    ax.set_xscale("log", base=2)
    all_T = sorted({int(t) for points in curves.values() for t in points})
    if all_T:
        ax.set_xticks(all_T)
        ax.set_xticklabels([str(t) for t in all_T])
        ax.minorticks_off()
    ax.set_xlabel("time steps T")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_history(history: Sequence[Mapping[str, float]], path: str | os.PathLike) -> None:
    """Loss and accuracy per epoch from a fine-tuning history."""
    records = [h for h in history if "epoch" in h]
    if not records:
        return
    epochs = [h["epoch"] for h in records]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    a1.plot(epochs, [h["loss"] for h in records], marker="o")
    a1.set_xlabel("epoch")
    a1.set_ylabel("training loss")
    for key in ("train_acc", "val_acc"):
        if any(key in h for h in records):
            a2.plot([h["epoch"] for h in records if key in h], [h[key] for h in records if key in h],
                    marker="o", label=key)
    a2.set_xlabel("epoch")
    a2.set_ylabel("accuracy (%)")
    a2.legend()
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
    _save(fig, path)
