"""The fine-tuning stage's data: the validation split and the per-process training loader.

A torch ``DataLoader`` over a sized dataset is split by sample and read through a seeded
``DistributedSampler``, so that every process count draws the same global batches and an epoch
replays identically after a resume; any other iterable of batches is split by batch (one
process only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from snnconv.data import split_dataset
from snnconv.errors import DataError

if TYPE_CHECKING:
    from snnconv.stages.finetune import FinetuneConfig

__all__ = ["TrainingData", "training_data", "training_size"]


@dataclass
class TrainingData:
    """The training loader of this process, the validation split (None: none held out), and
    for a DataLoader its sampler, its own generator (worker seeds) and the global batch size."""

    train: Iterable
    val: Iterable | None
    sampler: DistributedSampler | None = None
    generator: torch.Generator | None = None  # the train loader's own (worker seeds)
    global_batch: int | None = None

    def start_epoch(self, epoch: int, seed: int) -> None:
        """Fix this epoch's order and worker seeds from (seed, epoch) alone, never from the
        global RNG, so an epoch replays identically after a resume."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        if self.generator is not None:
            self.generator.manual_seed(seed * 1_000_003 + epoch)


def training_data(loader: Iterable, cfg: "FinetuneConfig", rank: int, world: int) -> TrainingData:
    """``loader`` split into training and validation data (``cfg.val_fraction``, ``cfg.seed``),
    the training part as process ``rank`` of ``world`` reads it.

    Raises:
        DataError: several processes without a DataLoader over a sized dataset, a batch size
            that cannot be told or that ``world`` does not divide.
    """
    if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__len__"):
        if world > 1:
            raise DataError("distributed fine-tuning needs a torch DataLoader over a sized dataset")
        from snnconv.data import split_loader

        train, val = split_loader(loader, cfg.val_fraction, seed=cfg.seed)
        return TrainingData(train, val)
    train_set: Any
    val_set: Any
    if cfg.val_fraction > 0:
        train_set, val_set = split_dataset(loader.dataset, cfg.val_fraction, seed=cfg.seed)
    else:
        train_set, val_set = loader.dataset, None
    batch = cfg.batch_size or loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if not batch:
        raise DataError("cannot tell the batch size of a DataLoader without automatic batching; "
                        "pass batch_size= to finetune()")
    if batch % world:
        raise DataError(f"the global batch size {batch} is not divisible by {world} processes")
    # Every process count draws the same global batches: a DistributedSampler over the seeded
    # permutation gives rank r the samples r, r + world, ... of it, so with one process it is
    # the permutation itself and the union over ranks of batch k is always the same set.
    sampler: DistributedSampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    common: dict[str, Any] = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                  pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn)
    # own generators: creating an iterator then draws from them, not from the global RNG
    generator = torch.Generator()
    train = DataLoader(train_set, batch_size=batch // world, sampler=sampler, drop_last=True,
                       generator=generator, **common)
    val = None
    if val_set is not None:
        val = DataLoader(val_set, batch_size=batch, shuffle=False,
                         generator=torch.Generator().manual_seed(cfg.seed), **common)
    return TrainingData(train, val, sampler, generator, batch)


def training_size(data: TrainingData) -> int | None:
    """Samples (a sized dataset) or batches (a list) of the training split; None if unknown."""
    for obj in (getattr(data.train, "dataset", None), data.train):
        try:
            return len(obj)  # type: ignore[arg-type]  # an unsized one raises TypeError
        except TypeError:
            continue
    return None
