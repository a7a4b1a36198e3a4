"""Fine-tuning under ``torchrun``: the process group, this process's device, sums over
processes, and the random state a checkpoint keeps."""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

__all__ = ["rank_world", "launched_distributed", "maybe_init_distributed", "local_device",
           "all_reduce_sum", "rng_state", "set_rng_state"]


def rank_world() -> tuple[int, int]:
    """This process's rank and the number of processes ((0, 1) outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_distributed() -> bool:
    """Started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available()


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def maybe_init_distributed(device: torch.device) -> None:
    """Join the process group torchrun set up, once per process; it lives until exit.

    Destroying it after each call and creating it again on the next one can deadlock (gloo
    and DDP under torch 2.14), so a script may call finetune() any number of times.
    """
    if launched_distributed() and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_destroy_process_group)


def local_device(device: torch.device) -> torch.device:
    """Under torchrun, a bare ``"cuda"`` means this process's GPU (``LOCAL_RANK``), not GPU 0."""
    if device.type == "cuda" and launched_distributed():
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # NCCL and DDP use the current device
    return device


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum ``t`` over processes into a new tensor (on ``device``: NCCL reduces GPU tensors only)."""
    out = t.to(device, copy=True)
    dist.all_reduce(out)
    return out.to(t.device)


def rng_state(device: torch.device) -> dict:
    """The CPU generator's state, and ``device``'s where it is a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
