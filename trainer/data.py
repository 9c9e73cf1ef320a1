"""Data loaders: every rank sees its own part of each epoch, with the user's batch size and shuffle setting."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


def _is_distributed(loader: DataLoader) -> bool:
    sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
    return isinstance(loader.sampler, DistributedSampler) or isinstance(sampler, DistributedSampler)


def distributed_loader(loader: Any, world_size: int, rank: int, seed: int, argument: str) -> Any:
    """Rebuild `loader` with a DistributedSampler that keeps its shuffle setting and per-rank batch size.
    A loader that already has a distributed sampler, or an iterable dataset, is left alone."""
    if loader is None:
        return None
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{argument} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset) or _is_distributed(loader):
        return loader
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)) or loader.batch_size is None:
        if world_size == 1:
            return loader
        raise ValueError(
            f"{argument}: a DataLoader with a custom sampler or batch_sampler cannot be split across "
            f"{world_size} ranks automatically; give it a DistributedSampler yourself"
        )
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
    )
    return DataLoader(
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


def set_epoch(loader: Any, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
        batch_sampler.sampler.set_epoch(epoch)


def limit_batches(loader: Any, limit: int | float, argument: str) -> int:
    """Number of batches to use per epoch from `limit` (a fraction of the loader or a count)."""
    try:
        available = len(loader)
    except TypeError:
        available = None
    if isinstance(limit, float):
        if available is None:
            if limit == 1.0:
                return 2**62
            raise ValueError(
                f"{argument}={limit} needs a loader with a length; give an int number of batches"
            )
        return int(available * limit)
    return limit if available is None else min(limit, available)
