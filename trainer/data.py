"""Data loaders: every rank sees its own part of each epoch, with the user's batch size.

Training keeps torch's and Lightning's habit: a DistributedSampler with the loader's shuffle setting, which repeats
a few samples when the dataset does not divide by the world size (reported once, on rank 0); it is one that can
resume in the middle of an epoch exactly (resume_sampler.py). Evaluation must see
every sample once, so it splits the dataset into contiguous shares without padding (`ShardSampler`); ranks may then
have different numbers of batches, which `uneven.py` deals with.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from .resume_sampler import ResumableSampler


class ShardSampler(Sampler[int]):
    """Rank `rank`'s contiguous share of the indices 0..length-1, in order and without padding. Shares differ by
    at most one sample (the first ranks hold the extra ones, so rank 0 has the most batches); concatenated in
    rank order they are the dataset in order."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.bounds = [-(-length * r // num_replicas) for r in range(num_replicas + 1)]  # the first get more
        self.rank = rank

    def __iter__(self):
        return iter(range(self.bounds[self.rank], self.bounds[self.rank + 1]))

    def __len__(self) -> int:
        return self.bounds[self.rank + 1] - self.bounds[self.rank]

    def sizes(self) -> list[int]:
        """Samples on each rank."""
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]


def _is_distributed(loader: DataLoader) -> bool:
    sampler = getattr(loader.batch_sampler, "sampler", None) if loader.batch_sampler is not None else loader.sampler
    distributed = (DistributedSampler, ShardSampler)
    return isinstance(loader.sampler, distributed) or isinstance(sampler, distributed)


def distributed_loader(
    loader: Any, world_size: int, rank: int, seed: int, argument: str, evaluation: bool = False
) -> Any:
    """Rebuild `loader` for this rank with its per-rank batch size: for training with a DistributedSampler that
    keeps its shuffle setting, for evaluation with a ShardSampler (in dataset order, each sample once). A loader
    that already has a distributed sampler, or an iterable dataset, is left alone."""
    if loader is None:
        return None
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{argument} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset) or _is_distributed(loader):
        _report_repeated_samples(loader, rank)
        return loader
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)) or loader.batch_size is None:
        if world_size == 1:
            return loader
        raise ValueError(
            f"{argument}: a DataLoader with a custom sampler or batch_sampler cannot be split across "
            f"{world_size} ranks automatically; give it a DistributedSampler yourself"
        )
    if evaluation:
        sampler: Sampler = ShardSampler(len(loader.dataset), world_size, rank)
    else:
        sampler = ResumableSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
            batch_size=loader.batch_size,
            seed_batches=loader.num_workers > 0,
        )
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
    )
    _report_repeated_samples(rebuilt, rank)
    return rebuilt


def _report_repeated_samples(loader: DataLoader, rank: int) -> None:
    """A DistributedSampler without drop_last pads the dataset to a multiple of the world size with repeats."""
    sampler = loader.sampler
    if rank != 0 or not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return
    repeated = sampler.total_size - len(sampler.dataset)
    if repeated:
        warnings.warn(
            f"the training set has {len(sampler.dataset)} samples, which does not divide by the "
            f"{sampler.num_replicas} ranks: DistributedSampler repeats {repeated} sample{'s' * (repeated > 1)} "
            "per epoch so that every rank gets as many. To train on each sample once per epoch instead, drop the "
            "remainder with DataLoader(..., drop_last=True).",
            stacklevel=3,
        )


def batches_per_rank(loader: Any) -> list[int] | None:
    """Batches of each rank for an evaluation loader split by ShardSampler; None for any other loader."""
    if not isinstance(getattr(loader, "sampler", None), ShardSampler) or loader.batch_size is None:
        return None
    count = (lambda n: n // loader.batch_size) if loader.drop_last else (lambda n: -(-n // loader.batch_size))
    return [count(n) for n in loader.sampler.sizes()]


def set_epoch(loader: Any, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
        batch_sampler.sampler.set_epoch(epoch)


def loader_length(loader: Any) -> int | None:
    """Batches per epoch, the same on every rank (the most any rank has, for a split evaluation loader); None
    when the loader has no length."""
    counts = batches_per_rank(loader)
    if counts is not None:
        return max(counts)
    try:
        return len(loader)
    except TypeError:
        return None


def limit_batches(loader: Any, limit: int | float, argument: str) -> int:
    """Number of batches to use per epoch from `limit` (a fraction of the loader or a count)."""
    available = loader_length(loader)
    if isinstance(limit, float):
        if available is None:
            if limit == 1.0:
                return 2**62
            raise ValueError(
                f"{argument}={limit} needs a loader with a length; give an int number of batches"
            )
        return int(available * limit)
    return limit if available is None else min(limit, available)
