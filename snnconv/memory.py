"""How much memory a stage may use, and how much one image needs in it.

Every stage that works through many images at once (the calibration's lockstep, the
reconstruction's and fine-tuning's training steps) sizes its pieces from :func:`budget_bytes`:
a share of what is free where it runs (CUDA's free memory, or Linux's ``MemAvailable``),
never more than ``SNNCONV_MEMORY`` where that is set. It refuses to run only where a single
image does not fit (:func:`refuse_one_image`).
"""

from __future__ import annotations

import os
import re
from typing import Callable

import torch
import torch.nn as nn

from snnconv.errors import ConfigError, ResourceError

__all__ = ["MEMORY_ENV", "BUDGET_SHARE", "CPU_STEP_BYTES", "TRAINING_FACTOR", "available_bytes",
           "memory_cap", "budget_bytes", "step_budget", "saved_bytes", "images_that_fit",
           "refuse_one_image", "gib"]

#: The environment variable that caps what the stages may use: bytes, or a number with K, M,
#: G or T (``SNNCONV_MEMORY=8G``).
MEMORY_ENV = "SNNCONV_MEMORY"

#: The share of the free memory a stage plans to use: on a GPU its own memory, on a CPU the
#: machine's, which the data loader, the page cache and other processes share.
BUDGET_SHARE = {"cuda": 0.8, "cpu": 0.5}

#: The most a training step's activations take on a CPU before it is cut into micro-batches:
#: larger batches buy no speed there (benchmarks/README.md, Defaults row "memory").
CPU_STEP_BYTES = 2 * 2**30

#: A training step's peak over the bytes autograd saves in its forward (:func:`saved_bytes`):
#: the backward's gradients and the forward's transients come on top. Measured (RSS high water
#: over the loaded model) 2.1x on ResNet-50 at 224 px, T=8, and 2.9x on ResNet-18 at 128 px.
TRAINING_FACTOR = 3.0

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def gib(n: float | None) -> str:
    """``n`` bytes in GiB, one decimal (``"?"`` for None)."""
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def available_bytes(device: torch.device | str) -> int | None:
    """Free memory on ``device`` (CUDA's, or Linux's MemAvailable); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_cap() -> int | None:
    """``SNNCONV_MEMORY`` in bytes (None where it is not set).

    Raises:
        ConfigError: a value that is not a size.
    """
    raw = os.environ.get(MEMORY_ENV, "").strip()
    if not raw:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", raw, flags=re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"{MEMORY_ENV}={raw!r} is not a size; give bytes or a number with K, M, G "
                          "or T (for example 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def budget_bytes(device: torch.device | str) -> int | None:
    """What a stage on ``device`` may plan to use: :data:`BUDGET_SHARE` of the free memory,
    at most ``SNNCONV_MEMORY``; None where neither is known."""
    device = torch.device(device)
    free, cap = available_bytes(device), memory_cap()
    share = None if free is None else int(free * BUDGET_SHARE.get(device.type, 0.5))
    if share is None:
        return cap
    return share if cap is None else min(share, cap)


def step_budget(device: torch.device | str) -> int | None:
    """What one training step's activations may take: :func:`budget_bytes`, and on a CPU at
    most :data:`CPU_STEP_BYTES`."""
    device = torch.device(device)
    budget = budget_bytes(device)
    if device.type != "cpu":
        return budget
    return CPU_STEP_BYTES if budget is None else min(budget, CPU_STEP_BYTES)


def saved_bytes(run: Callable[[], object], model: nn.Module | None = None) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``run()`` runs (each storage
    once; the parameters and buffers of ``model`` are not counted)."""
    own = set()
    if model is not None:
        own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def images_that_fit(per_image: int, budget: int | None, batch: int) -> int:
    """Images of ``batch`` whose ``per_image`` bytes fit ``budget`` together (at least one;
    the whole batch where the budget is unknown)."""
    if budget is None or per_image <= 0:
        return batch
    return max(1, min(batch, budget // per_image))


def refuse_one_image(per_image: float, device: torch.device | str, what: str, lower: str) -> None:
    """Raise ResourceError where ``per_image`` bytes (``what`` on one image) exceed what is free
    on ``device`` (or ``SNNCONV_MEMORY``); ``lower`` says what to change."""
    device = torch.device(device)
    free, cap = available_bytes(device), memory_cap()
    limit = min(x for x in (free, cap) if x is not None) if free is not None or cap is not None else None
    if limit is not None and per_image > limit:
        where = f"{gib(free)} free on {device}" + (f", {MEMORY_ENV}={gib(cap)}" if cap is not None else "")
        raise ResourceError(f"{what} needs about {gib(per_image)} for a single image, with {where}; "
                            f"{lower}, or run on a device with more memory")
