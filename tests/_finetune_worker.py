"""Runs snnconv.finetune in a separate process for test_resume.py and test_distributed.py.

    python _finetune_worker.py SNN_PATH OUT_PREFIX CONFIG_JSON [--hang-after N]

Loads the SpikingNetwork saved at SNN_PATH, fine-tunes it on scikit-learn digits (the training
split of ``snnconv.data.digits(seed=0)``, the same data the tests use) with the FinetuneConfig
fields in CONFIG_JSON (one object, or a list of objects for several runs in a row), and writes
``{state, history}`` of run i to ``OUT_PREFIX.rank<R>.pt`` (one run) or
``OUT_PREFIX.<i>.rank<R>.pt`` (a list).

``"{rank}"`` in ``checkpoint_dir`` is replaced by this process's rank. With ``--hang-after N``
the dataset blocks forever at its N+1-th item: the parent kills the process there, mid-epoch,
at a point it chose by reading the checkpoint (no timing race with the end of the epoch).
Under ``torchrun`` finetune() itself joins the process group (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading

import torch
from _interrupting import LimitedDataset
from torch.utils.data import DataLoader

logging.getLogger("spikingjelly").setLevel(logging.ERROR)


class HangingDataset(LimitedDataset):
    """``base`` until ``limit`` items have been read, then blocks forever."""

    def past_limit(self) -> None:
        threading.Event().wait()


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("snn")
    parser.add_argument("out")
    parser.add_argument("config")
    parser.add_argument("--hang-after", type=int, default=None)
    args = parser.parse_args()

    import snnconv
    from snnconv.data import digits

    rank = int(os.environ.get("RANK", "0"))
    runs = json.loads(args.config)
    single = isinstance(runs, dict)
    snn = snnconv.SpikingNetwork.load(args.snn)
    train_set, _ = digits(seed=0)
    if args.hang_after is not None:
        train_set = HangingDataset(train_set, args.hang_after)
    for i, options in enumerate([runs] if single else runs):
        if options.get("checkpoint_dir"):
            options["checkpoint_dir"] = options["checkpoint_dir"].replace("{rank}", str(rank))
        loader = DataLoader(train_set, batch_size=options.pop("loader_batch_size", 64))
        tuned, history = snnconv.finetune(snn, loader, progress=False, **options)
        out = f"{args.out}.rank{rank}.pt" if single else f"{args.out}.{i}.rank{rank}.pt"
        torch.save({"state": tuned.state_dict(), "history": history,
                    "world": int(os.environ.get("WORLD_SIZE", "1"))}, out)


if __name__ == "__main__":
    main()
