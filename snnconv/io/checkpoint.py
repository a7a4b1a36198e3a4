"""Fine-tuning checkpoint files: written atomically with a SHA-256, read as untrusted data.

A checkpoint is ``SNNCONV-CKPT-1\\n<sha256 hex>\\n<torch.save bytes>``. Reading checks the file
(:func:`snnconv.io.torchfile.read_regular`: a regular file within :data:`MAX_CHECKPOINT_BYTES`),
its SHA-256, the archive's inflated size, loads it with ``weights_only=True``, and
:func:`check_checkpoint` checks every field's type and range before fine-tuning uses it. The
SHA-256 is public arithmetic: it tells a damaged file from a whole one, not a forged file from
ours, so the field checks are what keep a forged one from steering a run.
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
from typing import Any

import torch
import torch.nn as nn

from snnconv.errors import CheckpointError
from snnconv.io.atomic import atomic_write_bytes
from snnconv.io.files import MAX_FILE_BYTES
from snnconv.io.torchfile import load_untrusted, read_regular

__all__ = ["MAX_CHECKPOINT_BYTES", "write_checkpoint", "read_checkpoint", "check_checkpoint"]

_MAGIC = b"SNNCONV-CKPT-1\n"
#: A checkpoint holds the network, the optimiser's state (two moments for Adam) and the best
#: epoch's weights: four networks' worth, so four times the one-file budget.
MAX_CHECKPOINT_BYTES = 4 * MAX_FILE_BYTES
#: the fields every checkpoint holds ("start_digest" and "data_size" came later: optional)
_KEYS = {"fingerprint", "config", "global_batch", "epoch", "step",
         "partial", "model", "optimizer", "scheduler", "scaler", "rng", "history", "best_val",
         "best_state"}


def write_checkpoint(path: str, payload: dict) -> None:
    """``payload`` (torch.save) behind the magic line and its SHA-256, atomically."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest().encode()
    atomic_write_bytes(path, _MAGIC + digest + b"\n" + data)


def read_checkpoint(path: str) -> dict:
    """Read and verify a fine-tuning checkpoint (sha256 checked, ``weights_only`` load).

    Raises:
        CheckpointError: not a regular file, larger than :data:`MAX_CHECKPOINT_BYTES`, a bad
            header, a SHA-256 that does not match, or contents that are not plain data.
    """
    raw = read_regular(path, "fine-tuning checkpoint", MAX_CHECKPOINT_BYTES)
    if not raw.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not an snnconv fine-tuning checkpoint (bad header)")
    head = len(_MAGIC)
    digest, data = raw[head:head + 64], raw[head + 65:]
    if hashlib.sha256(data).hexdigest().encode() != digest:
        raise CheckpointError(f"{path} is corrupted: its sha256 does not match its contents "
                              "(truncated or modified). Delete it to start over.")
    state = load_untrusted(path, "fine-tuning checkpoint", data=data, max_bytes=MAX_CHECKPOINT_BYTES)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint record")
    return state


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _tensors(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                           for k, v in value.items())


def check_checkpoint(path: str, state: dict, model: nn.Module, epochs: int,
                     steps_per_epoch: int | None) -> None:
    """Every field of a checkpoint has the type and range this run can continue from.

    Raises:
        CheckpointError: naming the first field that does not (missing, of another type, out of
            range: an epoch outside ``0..epochs``, a step outside the epoch, a history that is not
            a list of records, weights that are not this network's).
    """
    def refuse(field: str, why: str) -> None:
        raise CheckpointError(f"{path}: its field '{field}' {why}; the file is damaged or was not "
                              "written by snnconv. Delete it to start over")

    missing = sorted(_KEYS - set(state))
    if missing:
        refuse(missing[0], "is missing")
    epoch, step = state["epoch"], state["step"]
    if not _integer(epoch) or not 0 <= epoch <= epochs:
        refuse("epoch", f"is {epoch!r:.40}, not an epoch of this run (0 to {epochs})")
    if not _integer(step) or step < 0 or (steps_per_epoch is not None and step > steps_per_epoch):
        refuse("step", f"is {step!r:.40}, not a step of an epoch ({steps_per_epoch} steps)")
    partial = state["partial"]
    if step and not (isinstance(partial, list) and len(partial) == 3 and all(map(_number, partial))):
        refuse("partial", "is not the three sums of a mid-epoch checkpoint")
    history = state["history"]
    if not isinstance(history, list) or not all(
            isinstance(h, dict) and all(isinstance(k, str) and (_number(v) or v is None or isinstance(v, bool))
                                        for k, v in h.items()) for h in history):
        refuse("history", "is not a list of records of numbers")
    if len(history) > epochs:
        refuse("history", f"has {len(history)} epochs, more than the run's {epochs}")
    if not _number(state["best_val"]) or not -1.0 <= state["best_val"] <= 100.0:
        refuse("best_val", f"is {state['best_val']!r:.40}, not an accuracy")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for field in ("model", "best_state"):
        value = state[field]
        if field == "best_state" and value is None:
            continue
        if not _tensors(value) or {k: v.shape for k, v in value.items()} != shapes:
            raise CheckpointError(f"{path} was written for another model (its field '{field}' "
                                  "does not hold this network's parameter names and shapes); point "
                                  "checkpoint_dir elsewhere or delete the file")
        bad = [k for k, v in value.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            refuse(field, f"holds NaN or infinite values in '{bad[0]}'")
    for field in ("optimizer", "scheduler", "scaler", "rng", "config"):
        if not isinstance(state[field], dict):
            refuse(field, f"is a {type(state[field]).__name__}, not a record")
    if not isinstance(state["rng"].get("cpu"), torch.Tensor) or state["rng"]["cpu"].dtype != torch.uint8:
        refuse("rng", "does not hold the CPU generator's state (a uint8 tensor)")
