"""Never silent: a quantised network that flushes a layer's weights, or whose layers fire at
rates the float network does not, or whose decisions depart from the float network's, is flagged
(:func:`check`, :class:`QuantisationWarning`).

A layer is flagged when its rate departs from the float rate by more than
:data:`RATE_TOLERANCE`, or when more than :data:`FLUSH_TOLERANCE` of a connection's nonzero
weights round to zero. Layers that fire less than :data:`MIN_RATE` in the float network are
compared in absolute terms (a few spikes of a nearly silent layer are no evidence). Decisions are
judged over at least :data:`MIN_IMAGES` images against :data:`DECISION_TOLERANCE`. The
measurements behind each tolerance: benchmarks/README.md, "loihi2-sim's quantisation checks".
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from snnconv_backends.loihi2.network import QuantizedNetwork
from snnconv_backends.registry import RunWarning

__all__ = ["QuantisationWarning", "RATE_TOLERANCE", "FLUSH_TOLERANCE", "MIN_RATE", "DECISION_TOLERANCE",
           "MIN_IMAGES", "flushed",
           "check", "summary"]

#: Largest relative departure of a layer's firing rate from the float network's.
RATE_TOLERANCE = 0.2
#: Largest fraction of a connection's nonzero weights that may round to zero.
FLUSH_TOLERANCE = 0.5
#: Float rates below this (spikes per neuron per step) are compared as |chip - float| <= this * tolerance.
MIN_RATE = 0.01
#: Least share of images on which the chip's decision (the readout averaged over T, its argmax)
#: is the float network's, judged over at least :data:`MIN_IMAGES` images (layer rates within
#: tolerance do not make decisions agree where the float network's outputs are near ties).
DECISION_TOLERANCE = 0.9
#: Fewest images over which decisions are judged (at 64, a true 95% agreement reads below 90%
#: with probability 5%).
MIN_IMAGES = 64


class QuantisationWarning(RunWarning):
    """A quantised network departs from the float network beyond the stated tolerances."""


def flushed(q: QuantizedNetwork) -> dict[str, dict[str, Any]]:
    """Per connection (residual groups ``.lo`` merged into theirs): nonzero float weights and
    the fraction of them rounded to zero."""
    out: dict[str, dict[str, Any]] = {}
    lo = {c.name[:-3]: c for p in q.populations for c in p.conns if c.name.endswith(".lo")}
    for p in q.populations:
        for c in p.conns:
            if c.name.endswith(".lo") or c.kind == "bias":
                continue
            nz = int(c.report.get("float_nonzero", c.report.get("float_weights", c.mant.size)))
            zero = int(c.report.get("zero_rounded", 0))
            if c.name in lo:  # zero only where both groups are
                zero = int(c.report.get("zero_rounded_both", zero))
            out[c.name] = {"population": p.name, "weights": nz, "flushed": zero,
                           "fraction": zero / nz if nz else 0.0}
    return out


def check(q: QuantizedNetwork, chip: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor] | None,
          images: int, T: int, decisions: tuple[int, int] | None = None) -> dict[str, Any]:
    """Per layer: the chip's and the float network's firing rates and their ratio, and per
    connection the weights flushed; ``decisions``: (images on which the chip decides as the float
    network, images compared); ``warnings``: one line per departure beyond the tolerances."""
    sizes = {p.name: p.size for p in q.populations}
    layers: dict[str, Any] = {}
    warn = []
    for name, c in chip.items():
        n = sizes[name] * images * T
        rate = float(c.sum()) / n
        row = {"rate": rate}
        if ref is not None and name in ref:
            fr = float(ref[name].sum()) / n
            row.update(float_rate=fr, ratio=rate / fr if fr > 0 else (1.0 if rate == 0 else float("inf")))
            off = abs(rate - fr) > RATE_TOLERANCE * max(fr, MIN_RATE)
            if off:
                warn.append(f"{name} fires {100 * rate:.2f}% of the steps against {100 * fr:.2f}% in the "
                            f"float network (tolerance {100 * RATE_TOLERANCE:.0f}%)")
        layers[name] = row
    fl = flushed(q)
    for cname, f in fl.items():
        if f["fraction"] > FLUSH_TOLERANCE:
            warn.append(f"{cname} ({f['population']}): {100 * f['fraction']:.0f}% of its weights round to "
                        f"zero (tolerance {100 * FLUSH_TOLERANCE:.0f}%)")
    agreement = None
    if decisions is not None and decisions[1]:
        agreement = decisions[0] / decisions[1]
        if decisions[1] >= MIN_IMAGES and agreement < DECISION_TOLERANCE:
            warn.append(f"its decisions are the float network's on {100 * agreement:.1f}% of {decisions[1]} "
                        f"images (tolerance {100 * DECISION_TOLERANCE:.0f}%): the float network's outputs "
                        "are near ties that fixed-point rounding flips; fine-tune the network (snnconv "
                        "finetune RUN) to widen its margins, or run it for more steps (--T)")
    ratios = [r["ratio"] for r in layers.values() if "ratio" in r and np.isfinite(r["ratio"])]
    return {"layers": layers, "connections": fl, "warnings": warn,
            "lowest_rate_ratio": min(ratios) if ratios else None,
            "decision_agreement": agreement, "decisions": list(decisions) if decisions else None,
            "tolerances": {"rate": RATE_TOLERANCE, "flush": FLUSH_TOLERANCE, "min_rate": MIN_RATE,
                           "decisions": DECISION_TOLERANCE, "min_images": MIN_IMAGES}}


def summary(fid: Mapping[str, Any], backend: str) -> str:
    """One line: the departures found, or that there are none."""
    w = fid["warnings"]
    if not w:
        return (f"{backend}: quantisation within tolerance (every layer's rate within "
                f"{100 * RATE_TOLERANCE:.0f}% of the float network's)")
    return f"{backend}: quantisation departs from the float network in {len(w)} place(s): " + "; ".join(w[:3]) + (
        f"; and {len(w) - 3} more" if len(w) > 3 else "")
