"""Fine-tune a converted SNN on several processes with torchrun: one machine or several.

One process converts (digits -> small CNN -> SNN, no fine-tuning) and saves the network; every
process then loads it and calls ``snnconv.finetune`` on the same DataLoader, which splits each
global batch over the processes (DistributedDataParallel: gloo on CPU, NCCL on GPUs, one GPU
per process). Only rank 0 writes files.

    # one machine, 2 processes on the CPU
    torchrun --nproc_per_node=2 examples/finetune_ddp.py --out runs/ddp
    # one machine, 4 GPUs
    torchrun --nproc_per_node=4 examples/finetune_ddp.py --device cuda --out runs/ddp
    # two machines with 4 GPUs each: the same command on both, --node_rank 0 on the machine
    # at --master_addr, 1 on the other; --out on a file system both can read
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --master_addr=10.0.0.1 --master_port=29500 \\
        examples/finetune_ddp.py --device cuda --out /shared/runs/ddp

Every process must start from the same network, data set (same samples in the same order:
no per-process shuffling or sharding, finetune() does it), settings (seed, T, epochs, global
batch size divisible by the number of processes) and snnconv and torch versions. Run without
torchrun it fine-tunes on one process, and ends where the processes end: the same global
batches, up to the order of floating-point sums.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import snnconv
from snnconv.analysis.metrics import accuracy_by_T
from snnconv.data import digits
from snnconv.demo import train_ann
from snnconv.distributed import launched_distributed, local_device, rank_world
from snnconv.io.atomic import atomic_write_text
from snnconv.models import small_cnn


def convert_once(path: str, train_set, args) -> None:
    """Rank 0's step: train the ANN, convert it without fine-tuning, save the SNN."""
    torch.manual_seed(args.seed)
    loader = DataLoader(train_set, batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    ann = train_ann(small_cnn(num_classes=10, in_channels=1, width=args.width), loader,
                    epochs=args.train_epochs, progress=False)
    # finetune_epochs=0: convert() would otherwise fine-tune here, on this one process
    snn, _ = snnconv.convert(ann, loader, T=args.T, finetune_epochs=0, seed=args.seed, progress=False)
    snn.save(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/ddp")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, the process's LOCAL_RANK GPU)")
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="the global batch, over all processes")
    p.add_argument("--max-steps", type=int, default=None, help="optimiser steps per epoch at most")
    p.add_argument("--train-epochs", type=int, default=15, help="of the ANN, before conversion")
    p.add_argument("--width", type=int, default=32, help="the small CNN's width")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = local_device(torch.device(args.device))  # under torchrun "cuda" is cuda:LOCAL_RANK
    if launched_distributed():  # finetune() would join the group itself; here the barrier needs it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = rank_world()
    train_set, test_set = digits(seed=args.seed)  # the same samples in the same order everywhere
    snn_path = os.path.join(args.out, "snn.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(snn_path):
            convert_once(snn_path, train_set, args)
    if world > 1:
        dist.barrier()  # the others wait for rank 0's network

    snn = snnconv.SpikingNetwork.load(snn_path)
    loader = DataLoader(train_set, batch_size=args.batch)  # the global batch; finetune() shards it
    tuned, history = snnconv.finetune(
        snn, loader, T=args.T, epochs=args.epochs, seed=args.seed, device=device,
        max_steps_per_epoch=args.max_steps, checkpoint_dir=os.path.join(args.out, "checkpoints"),
        progress=rank == 0)

    if rank == 0:
        tuned = tuned.to("cpu")
        tuned.save(os.path.join(args.out, "snn_finetuned.pt"))
        acc = accuracy_by_T(tuned, DataLoader(test_set, batch_size=256), [args.T])[args.T]
        atomic_write_text(os.path.join(args.out, "finetune.json"), json.dumps(
            {"processes": world, "device": str(device), "T": args.T, "global_batch": args.batch,
             "history": history, "test_accuracy": acc}, indent=1) + "\n")
        print(f"{world} process(es): test accuracy at T={args.T} {acc:.2f}%; "
              f"wrote {args.out}/snn_finetuned.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
