"""The training sampler the Trainer builds: torch's DistributedSampler, plus what an exact mid-epoch resume needs.

- It can start an epoch at a given batch, so a resumed run does not load (nor augment) again the batches trained
  before the checkpoint.
- With DataLoader workers, each batch is loaded with the random state made for it, from the run's seed, the
  epoch, the rank and the batch's number. A worker's random state otherwise runs on from batch to batch (seeded
  once, when the worker starts), so after a resume that skipped batches, augmentation in `__getitem__` drew
  other numbers. How: the first index of each batch carries the batch's seed, and unpickling it in the worker
  (the index list travels through a queue, pickled, just before the worker loads that batch) seeds torch's,
  Python's and NumPy's generators; the dataset sees plain ints. Without workers, augmentation draws from the
  main process's generator, which the checkpoint restores.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int, drop_last: bool,
                 batch_size: int, seed_batches: bool) -> None:
        """`seed_batches`: give each batch its own random state in the DataLoader's workers (num_workers > 0)."""
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size, self.seed_batches = batch_size, seed_batches
        self.run_seed = torch.initial_seed()  # what torch.manual_seed / seed_everything set: it changes the seeds
        self._start_batch = 0

    def start_at_batch(self, batch: int) -> None:
        """The next epoch's iteration (only that one) starts at batch `batch` of this rank."""
        self._start_batch = batch

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._start_batch = self._start_batch * self.batch_size, 0
        for position in range(start, len(indices)):
            if self.seed_batches and position % self.batch_size == 0:
                yield _SeededIndex(indices[position], self._batch_seed(position // self.batch_size))
            else:
                yield indices[position]

    def _batch_seed(self, batch: int) -> int:
        key = f"{self.run_seed}/{self.seed}/{self.epoch}/{self.rank}/{batch}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class _SeededIndex(int):
    """A dataset index that seeds the random generators of the process that unpickles it (a DataLoader worker)."""

    seed: int

    def __new__(cls, index: int, seed: int) -> _SeededIndex:
        value = super().__new__(cls, index)
        value.seed = seed
        return value

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return _seed_then_index, (int(self), self.seed)


def _seed_then_index(index: int, seed: int) -> int:
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    return index


def start_at_batch(loader: Any, batch: int) -> bool:
    """Make `loader`'s next epoch start at `batch`, if its sampler is one the Trainer built; False otherwise."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler):
        return False
    sampler.start_at_batch(batch)
    return True
