"""What a conversion amounts to, in a line: how many images an accuracy was measured on, and
whether fine-tuning trained the spiking network beyond the ANN it was converted from."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Mapping

__all__ = ["images_in", "beyond_ann", "say_beyond_ann"]


def images_in(loader: Iterable) -> int | None:
    """The number of samples one pass over ``loader`` yields, where it can be known without
    iterating (a DataLoader over a sized dataset, or a list of ``(x, y)`` batches); else None."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is not None and hasattr(getattr(sampler, "sampler", None), "__len__"):
        n, size = len(sampler.sampler), getattr(sampler, "batch_size", None)
        return (n // size) * size if getattr(sampler, "drop_last", False) and size else n
    if isinstance(loader, (list, tuple)):
        try:
            return sum(len(b[0] if isinstance(b, (list, tuple)) else b) for b in loader)
        except TypeError:
            return None
    return None


def _stage(meta: Any, name: str) -> Mapping[str, Any]:
    stages = meta.get("stages", []) if isinstance(meta, Mapping) else [vars(s) for s in meta.stages]
    return next((s.get("changes") or {} for s in stages if s.get("name") == name), {})


def beyond_ann(meta: Any) -> dict[str, Any] | None:
    """Where fine-tuning (convert()'s BPTT stage) left the SNN more accurate than its ANN on the
    same data: ``{"snn", "ann", "T", "images", "data"}``; None otherwise (no fine-tuning, or not
    above). ``meta`` is a :class:`~snnconv.meta.ConversionMeta` or its JSON as a dict.

    The data are the evaluation loader's where convert() had one (``images`` then its count,
    where known), else the calibration batches its stage checks run on (training data)."""
    settings = meta.get("settings", {}) if isinstance(meta, Mapping) else meta.settings
    acc = meta.get("accuracy", {}) if isinstance(meta, Mapping) else meta.accuracy
    tuned = _stage(meta, "finetune")
    if not tuned.get("history"):
        return None
    T = settings.get("T")
    snn = (acc.get("snn") or {}).get(str(T))
    if isinstance(acc.get("ann"), (int, float)) and isinstance(snn, (int, float)):
        found = {"snn": snn, "ann": acc["ann"], "T": T, "images": settings.get("eval_images"),
                 "data": "the evaluation data"}
    else:
        ann = _stage(meta, "fold").get("check_accuracy")
        if not isinstance(ann, (int, float)) or not isinstance(tuned.get("check_accuracy"), (int, float)):
            return None
        found = {"snn": tuned["check_accuracy"], "ann": ann, "T": T, "images": None,
                 "data": "the calibration batches (training data)"}
    return found if found["snn"] > found["ann"] else None


def say_beyond_ann(meta: Any, progress: bool = True, file: Any = None) -> str | None:
    """One line on stderr (when ``progress``) where :func:`beyond_ann` finds the SNN above its
    ANN; the line is returned either way (None where it is not above)."""
    found = beyond_ann(meta)
    if found is None:
        return None
    on = f"the same {found['images']} images" if found["images"] else found["data"]
    line = (f"fine-tuning trained the SNN beyond its ANN: {found['snn']:.2f}% at T={found['T']} against "
            f"the ANN's {found['ann']:.2f}% on {on}; the SNN is a further-trained network, not only "
            "a conversion of this ANN")
    if progress:
        print(line, file=file if file is not None else sys.stderr, flush=True)
    return line
