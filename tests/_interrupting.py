"""A dataset that crashes in the middle of an epoch (shared by the resume tests)."""

from __future__ import annotations

from torch.utils.data import Dataset


class Interrupt(Exception):
    pass


class LimitedDataset(Dataset):
    """``base`` until ``limit`` items have been read; each read past it calls :meth:`past_limit`."""

    def __init__(self, base: Dataset, limit: int):
        self.base, self.limit, self.count = base, limit, 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        self.count += 1
        if self.count > self.limit:
            self.past_limit()
        return self.base[i]

    def past_limit(self) -> None:
        raise NotImplementedError


class InterruptingDataset(LimitedDataset):
    """Raises :class:`Interrupt` at its ``limit + 1``-th read: a crash in the middle of an epoch."""

    def past_limit(self) -> None:
        raise Interrupt
