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

__all__ = ["plot_accuracy_vs_T", "plot_history", "draw_diagnosis", "plot_diagnosis", "draw_exit", "curve_points",
           "draw_accuracy", "draw_firing", "draw_thresholds", "draw_raster", "draw_history", "draw_ops", "draw_energy"]


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


def curve_points(points: Mapping[Any, float]) -> tuple[list[int], list[float]]:
    Ts = sorted(int(t) for t in points)
    return Ts, [float(points[str(t)] if str(t) in points else points[t]) for t in Ts]


def draw_accuracy(ax, acc: Mapping[str, Any], tuned: Mapping[str, float] | None,
                   points: list[tuple[str, int, float]], evaluated: tuple[str, Mapping[str, float]] | None = None
                   ) -> None:
    """The SNN's accuracy by T (converted, evaluated, fine-tuned), the ANNs as lines, and
    ``points`` (``(label, T, accuracy)``: backends, already cleared of few-image results); the
    legend beside the axes, where it covers no point."""
    all_T: set[int] = set()
    if acc.get("snn"):
        Ts, ys = curve_points(acc["snn"])
        ax.plot(Ts, ys, marker="o", label="SNN (converted)")
        all_T |= set(Ts)
    if evaluated:
        Ts, ys = curve_points(evaluated[1])
        ax.plot(Ts, ys, marker="D", linestyle=":", label=evaluated[0])
        all_T |= set(Ts)
    if tuned:
        Ts, ys = curve_points(tuned)
        ax.plot(Ts, ys, marker="s", label="SNN (snnconv finetune)")
        all_T |= set(Ts)
    for i, (label, T, value) in enumerate(points):
        ax.scatter([T], [value], marker="x", s=60, zorder=5, color=f"C{(i + 4) % 10}", label=label)
        all_T.add(T)
    for j, (key, label) in enumerate((("ann", "ANN"), ("qcfs", "QCFS-ANN"))):
        if isinstance(acc.get(key), (int, float)):
            ax.axhline(acc[key], linestyle="--", color=f"C{j + 2}", label=f"{label} ({acc[key]:.1f}%)")
    ax.set_xscale("log", base=2)
    if all_T:
        ticks = sorted(all_T)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("time steps T")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title("Accuracy against time steps")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def draw_firing(ax, rates: Mapping[str, float]) -> None:
    names = list(rates)
    ax.bar(range(len(names)), [100 * rates[n] for n in names], color="C0")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("firing rate (% of neurons per step)")
    ax.set_title("Firing rate per layer")
    ax.grid(True, axis="y", alpha=0.3)


def draw_thresholds(ax, thetas: Mapping[str, list[float]]) -> None:
    names = list(thetas)
    ax.boxplot([thetas[n] for n in names], whis=(0, 100))
    ax.set_xticks(range(1, len(names) + 1))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("threshold theta")
    ax.set_title("Thresholds per layer (per-channel values as a box)")
    ax.grid(True, axis="y", alpha=0.3)


def draw_raster(ax, raster: Mapping[str, list[list[int]]], T: int, per_layer: int) -> None:
    names = list(raster)
    for i, name in enumerate(names):
        pts = raster[name]
        if pts:
            ax.scatter([p[0] + 1 for p in pts], [i * per_layer + p[1] for p in pts], s=4,
                       marker="|", color=f"C{i % 10}")
    ax.set_yticks([i * per_layer + per_layer / 2 for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlim(0.5, T + 0.5)
    ax.set_xticks(range(1, T + 1, max(1, T // 16)))
    ax.set_ylim(0, max(1, len(names)) * per_layer)
    ax.set_xlabel("time step")
    ax.set_title(f"Spike raster: first {per_layer} neurons of each layer, image 0")


def draw_history(ax, history: list[Mapping[str, float]], title: str) -> None:
    records = [h for h in history if "epoch" in h]
    epochs = [h["epoch"] for h in records]
    ax.plot(epochs, [h["loss"] for h in records], marker="o", color="C0", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    for i, key in enumerate(("train_acc", "val_acc")):
        pts = [(h["epoch"], h[key]) for h in records if key in h]
        if pts:
            ax2.plot(*zip(*pts), marker="s", color=f"C{i + 1}", label=key.replace("_", " "))
    ax2.set_ylabel("accuracy (%)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def draw_ops(ax, synops: Mapping[str, float], macs: Mapping[str, float],
              static: Mapping[str, float]) -> None:
    names = list(macs)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [macs[n] for n in names], width=0.4, label="ANN MACs")
    ax.bar([x + 0.2 for x in xs], [synops.get(n, 0.0) for n in names], width=0.4,
           label="SNN accumulates (whole run)", color="C1")
    ax.bar([x + 0.2 for x in xs], [static.get(n, 0.0) for n in names], width=0.4,
           label="SNN MACs (static input, once)", color="C1", hatch="//", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("operations (batch)")
    ax.set_title("Synaptic operations against MACs per layer")
    ax.legend(fontsize=8)


def draw_energy(ax, rows: list[tuple[str, float]]) -> None:
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax.set_xlabel("energy per image (nJ)")
    ax.set_title("Energy estimates per inference")
    ax.grid(True, axis="x", alpha=0.3)
