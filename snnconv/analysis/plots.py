"""Headless matplotlib plots: accuracy against T, training curves, the diagnosis. Files are written
atomically."""

from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from snnconv.io.atomic import atomic_write_bytes  # noqa: E402

__all__ = ["plot_accuracy_vs_T", "plot_history", "draw_diagnosis", "plot_diagnosis", "draw_exit"]


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


def draw_diagnosis(diag: Any, axes: Sequence[Any]) -> None:
    """On two axes: each IF layer's departure from the ANN by cause (relative RMS, stacked in
    network order), and what running it as its ANN activation recovers (KL to the ANN removed),
    the main layers marked."""
    layers = [layer for layer in diag.layers if layer.causes]
    x = list(range(len(layers)))
    bottom = [0.0] * len(layers)
    a1, a2 = axes
    for i, cause in enumerate(("carried", "clip", "quantisation", "temporal")):
        vals = [layer.causes.get(cause, 0.0) for layer in layers]
        a1.bar(x, vals, bottom=bottom, color=f"C{i}", label=cause, width=0.9)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a1.plot(x, [layer.departure for layer in layers], "k.", markersize=4, label="departure (RMS)")
    a1.set_ylabel("RMS error / RMS of the ANN")
    a1.set_title(f"where the SNN departs from the ANN at T={diag.T} (causes stacked)")
    a1.legend(fontsize=7, ncol=5, loc="upper left")
    main = set(diag.main)
    gains = [layer.kl_recovered for layer in layers]
    a2.bar(x, gains, color=["C3" if layer.name in main else "C7" for layer in layers], width=0.9)
    a2.axhline(0, color="k", linewidth=0.5)
    a2.set_ylabel("KL to the ANN removed")
    a2.set_xlabel("IF layer (network order); red: the main losses")
    a2.set_title("each layer run alone as its ANN activation")
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlim(-0.6, max(len(layers), 1) - 0.4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_diagnosis(diag: Any, path: str | os.PathLike) -> None:
    """:func:`draw_diagnosis` as one figure at ``path``."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    draw_diagnosis(diag, axes)
    _save(fig, path)


def draw_exit(record: Mapping[str, Any], axes: Sequence[Any]) -> None:
    """On two axes, an early-exit evaluation (``evaluation.json``'s ``early_exit``): accuracy
    against mean steps (the rule's kind at every threshold, the fixed-T runs cut at each step,
    the rule's own point) and the histogram of exit steps."""
    a1, a2 = axes
    T = int(record["T"])
    curve, by_step = record.get("curve"), record.get("accuracy_by_step")
    tops = [float(record["accuracy"])]
    if curve:
        a1.plot(curve["mean_steps"], curve["accuracy"], color="C0",
                label=f"early exit, {curve['kind']} at every threshold")
        tops.append(max(curve["accuracy"]))
    if by_step:
        a1.plot(range(1, len(by_step) + 1), by_step, "o--", color="grey", label="fixed T = 1 .. T")
        tops.append(max(by_step))
    a1.scatter([record["mean_steps"]], [record["accuracy"]], marker="*", s=160, color="C3", zorder=5,
               label=f"the rule: {record['accuracy']:.2f}% at {record['mean_steps']:.2f} steps")
    a1.set_ylim(max(tops) - 15, max(tops) + 1)
    a1.set_xlabel("mean time steps per image")
    a1.set_ylabel("top-1 accuracy (%)")
    a1.set_title("accuracy against mean steps")
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=7, loc="lower right")
    hist = list(record["histogram"])
    a2.bar(range(1, len(hist) + 1), hist, color="C0")
    a2.set_xticks(range(1, T + 1))
    a2.set_xlabel("exit step")
    a2.set_ylabel("images")
    a2.set_title(f"exit steps ({sum(hist):,} images)")
    a2.grid(True, axis="y", alpha=0.3)
