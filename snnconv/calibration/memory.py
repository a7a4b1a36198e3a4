"""How much memory bias calibration's lockstep needs, against what is free: refused before it
runs (an out-of-memory kill says nothing)."""

from __future__ import annotations

import torch

from ..errors import ResourceError
from ..memory import available_bytes

__all__ = ["available_bytes", "refuse_if_short_of_memory"]


def refuse_if_short_of_memory(per_image: int, batches: list, T: int) -> None:
    """Raise ResourceError before the lockstep runs where it will not fit.
    It needs about twice its largest value (``per_image``, all T steps of one image) over all
    images: ResNet-18's measured peaks, 5.1 and 8.1 GiB at 16 and 32 steps, are 2.0-2.5 times
    that value (2 and 4 GiB)."""
    images = sum(len(x) for x in batches)
    need, free = 2 * per_image * images, available_bytes(batches[0].device)
    if free is not None and need > free:
        raise ResourceError(
            f"bias calibration runs its {len(batches)} batches ({images} images) together for {T} "
            f"steps: about {need / 2**30:.1f} GiB, with {free / 2**30:.1f} GiB free on {batches[0].device}; "
            "calibrate on fewer batches (convert(calib_batches=...) below 4, "
            "calibrate_bias(num_batches=...)), pass a loader with smaller batches, or a smaller T")

