"""The training sampler the Trainer builds: torch's DistributedSampler, plus what an exact mid-epoch resume needs.

- It can start an epoch at a given batch, so a resumed run does not load (nor augment) again the batches trained
  before the checkpoint. Rank r takes every world_size-th sample of the epoch's permutation from r on, so the
  first k batches of every rank are the permutation's first k * batch_size * world_size samples, at any world size
  (global_batch.py converts a position to another number of ranks).
- With DataLoader workers, each sample is loaded with a random state of its own, made from the run's seed, the
  epoch and the sample's place in the epoch's permutation (not the rank's nor the batch's, so that it is the same
  on any number of ranks). A worker's random state otherwise runs on from batch to batch (seeded once, when the
  worker starts), so after a resume that skipped batches, or on another number of ranks, augmentation in
  `__getitem__` drew other numbers. How: every index the sampler yields carries its sample's seed (an int that
  the dataset sees as a plain one), and the dataset's batch fetch (`__getitems__`, which torch's DataLoader uses
  when a dataset has one) seeds torch's, Python's and NumPy's generators before each sample. Without workers,
  augmentation draws from the main process's generator, which the checkpoint restores on the same world size.
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
    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        batch_size: int,
        seed_samples: bool,
    ) -> None:
        """`seed_samples`: load each sample with its own random state in the DataLoader's workers (num_workers >
        0); the dataset's `__getitems__` is set to seed them (`seed_each_sample`)."""
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size, self.seed_samples = batch_size, seed_samples
        if seed_samples:
            seed_each_sample(dataset)
        self.run_seed = torch.initial_seed()  # what torch.manual_seed / seed_everything set: it changes the seeds
        self._start_batch = 0

    def start_at_batch(self, batch: int) -> None:
        """The next epoch's iteration (only that one) starts at batch `batch` of this rank."""
        self._start_batch = batch

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._start_batch = self._start_batch * self.batch_size, 0
        for position in range(start, len(indices)):
            if self.seed_samples:  # its place in the epoch's permutation: the same on any number of ranks
                yield _SeededIndex(indices[position], self._sample_seed(position * self.num_replicas + self.rank))
            else:
                yield indices[position]

    def _sample_seed(self, place: int) -> int:
        key = f"{self.run_seed}/{self.seed}/{self.epoch}/{place}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class _SeededIndex(int):
    """A dataset index with the seed its sample is loaded with."""

    seed: int

    def __new__(cls, index: int, seed: int) -> _SeededIndex:
        value = super().__new__(cls, index)
        value.seed = seed
        return value

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return _SeededIndex, (int(self), self.seed)


def seed_each_sample(dataset: Dataset) -> None:
    """Set `dataset.__getitems__` (on the object; its class keeps its own) to load each index that carries a seed
    right after seeding the random generators with it. torch's DataLoader fetches a batch through `__getitems__`
    when the dataset has one; for indices without seeds (another loader's) it behaves as the dataset did."""
    if not isinstance(vars(dataset).get("__getitems__"), _SeedingFetch):
        try:
            dataset.__getitems__ = _SeedingFetch(dataset)
        except AttributeError:  # an object without a __dict__: its samples draw from the worker's running state
            pass


class _SeedingFetch:
    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.batched = getattr(type(dataset), "__getitems__", None)  # the class's own batch fetch, if any

    def __call__(self, indices: list[int]) -> list[Any]:
        if not any(isinstance(index, _SeededIndex) for index in indices):
            return self.batched(self.dataset, indices) if self.batched else [self.dataset[i] for i in indices]
        samples = []
        for index in indices:
            if isinstance(index, _SeededIndex):
                _seed_generators(index.seed)
            plain = int(index)
            samples.append(self.batched(self.dataset, [plain])[0] if self.batched else self.dataset[plain])
        return samples


def _seed_generators(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def start_at_batch(loader: Any, batch: int) -> bool:
    """Make `loader`'s next epoch start at `batch`, if its sampler is one the Trainer built; False otherwise."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler):
        return False
    sampler.start_at_batch(batch)
    return True
