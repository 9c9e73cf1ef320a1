"""Data loaders: every rank sees its own part of each epoch, with the user's batch size.

Training keeps torch's and Lightning's habit: a DistributedSampler with the loader's shuffle setting, which repeats
a few samples when the dataset does not divide by the world size (reported once, on rank 0); it is one that can
resume in the middle of an epoch exactly (resume_sampler.py). Evaluation must see every sample once, so it splits
the dataset into contiguous shares without padding (`ShardBatchSampler`), in as many batches on every rank where
the shares allow it; where they do not, and for iterable datasets, `uneven.py` lets a rank without a batch take
part in the others' steps.
"""

from __future__ import annotations

import sys
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


class ShardBatchSampler(Sampler[list[int]]):
    """Rank `rank`'s contiguous share of the indices 0..length-1 in batches, in order and without padding; the
    shares differ by at most one sample (the first ranks hold the extra ones) and, concatenated in rank order, are
    the dataset in order. Every rank gets as many batches as the largest share needs, a few of them smaller than
    `batch_size`, so no rank runs out before the others: that holds unless a share has fewer samples than that
    number of batches (batch_size=1 with a remainder, fewer samples than ranks). With `drop_last` each share drops
    its own remainder."""

    def __init__(self, length: int, num_replicas: int, rank: int, batch_size: int, drop_last: bool = False) -> None:
        bounds = [-(-length * r // num_replicas) for r in range(num_replicas + 1)]  # the first get more
        shares = [b - a for a, b in zip(bounds, bounds[1:])]
        batches = max(shares) // batch_size if drop_last else -(-max(shares) // batch_size)
        self.sizes_by_rank = [_batch_sizes(share, batches, batch_size, drop_last) for share in shares]
        self.start, self.rank = bounds[rank], rank

    def __iter__(self):
        start = self.start
        for size in self.sizes_by_rank[self.rank]:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes_by_rank[self.rank])

    def batches_per_rank(self) -> list[int]:
        return [len(sizes) for sizes in self.sizes_by_rank]


def _batch_sizes(share: int, batches: int, batch_size: int, drop_last: bool) -> list[int]:
    """`share` samples in `batches` batches of at most `batch_size`: full batches first, then as many one sample
    smaller as it takes for none to be empty; fewer batches when the share is too small for that many."""
    if drop_last or share < batches:
        full, rest = divmod(share, batch_size)
        return [batch_size] * full + ([rest] if rest and not drop_last else [])
    sizes = []
    for left_after in range(batches - 1, -1, -1):
        sizes.append(min(batch_size, share - left_after))
        share -= sizes[-1]
    return sizes


def _is_distributed(loader: DataLoader) -> bool:
    if isinstance(loader.batch_sampler, ShardBatchSampler):
        return True
    sampler = getattr(loader.batch_sampler, "sampler", None) if loader.batch_sampler is not None else loader.sampler
    return isinstance(loader.sampler, DistributedSampler) or isinstance(sampler, DistributedSampler)


def distributed_loader(
    loader: Any, world_size: int, rank: int, seed: int, argument: str, evaluation: bool = False
) -> Any:
    """Rebuild `loader` for this rank with its per-rank batch size: for training with a DistributedSampler that
    keeps its shuffle setting, for evaluation with a ShardBatchSampler (in dataset order, each sample once, the
    same number of batches on every rank). A loader that already has a distributed sampler, or an iterable dataset,
    is left alone."""
    if loader is None:
        return None
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{argument} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset) or _is_distributed(loader):
        _report_repeated_samples(loader, rank)
        return loader
    random_samplers = (RandomSampler, *_torchdata_random_sampler())
    if not isinstance(loader.sampler, (*random_samplers, SequentialSampler)) or loader.batch_size is None:
        if world_size == 1:
            return loader
        raise ValueError(
            f"{argument}: a DataLoader with a custom sampler or batch_sampler cannot be split across "
            f"{world_size} ranks automatically; give it a DistributedSampler yourself"
        )
    if evaluation:
        batches = ShardBatchSampler(len(loader.dataset), world_size, rank, loader.batch_size, loader.drop_last)
        sampling: dict[str, Any] = {"batch_sampler": batches}
    else:
        sampler = ResumableSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=isinstance(loader.sampler, random_samplers),
            seed=seed,
            drop_last=loader.drop_last,
            batch_size=loader.batch_size,
            seed_samples=loader.num_workers > 0,
        )
        sampling = {"batch_size": loader.batch_size, "sampler": sampler, "drop_last": loader.drop_last}
    rebuilt = like(loader, loader.dataset, **sampling)
    _report_repeated_samples(rebuilt, rank)
    return rebuilt


def like(loader: DataLoader, dataset: Any, workers: int | None = None, persistent: bool = True, **sampling) -> Any:
    """A loader of `loader`'s kind and options over `dataset`, batched by `sampling` (batch_size, sampler,
    batch_sampler, drop_last), with `workers` (default: as many as `loader`'s), kept between epochs only if
    `persistent` and `loader`'s were."""
    loader_class, extra = _same_kind(loader)
    workers = loader.num_workers if workers is None else workers
    return loader_class(
        dataset,
        **sampling,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=(loader.prefetch_factor or 2) if workers > 0 else None,
        persistent_workers=persistent and loader.persistent_workers and workers > 0,
        **extra,
    )


def _torchdata_random_sampler() -> tuple[type, ...]:
    """torchdata's RandomSampler (what StatefulDataLoader(shuffle=True) makes), when torchdata is in use."""
    module = sys.modules.get("torchdata.stateful_dataloader.sampler")
    return (module.RandomSampler,) if module is not None else ()


def _same_kind(loader: DataLoader) -> tuple[type, dict[str, Any]]:
    """The class to rebuild `loader` as, and its own further arguments: torchdata's StatefulDataLoader stays one
    (its position is then the Trainer's sampler's, as for a DataLoader); any other loader becomes a DataLoader."""
    stateful = getattr(sys.modules.get("torchdata.stateful_dataloader"), "StatefulDataLoader", None)
    if stateful is not None and isinstance(loader, stateful):
        return stateful, {"snapshot_every_n_steps": loader.snapshot_every_n_steps, "in_order": loader.in_order}
    return DataLoader, {}


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
    """Batches of each rank for an evaluation loader split by ShardBatchSampler; None for any other loader."""
    batches = getattr(loader, "batch_sampler", None)
    return batches.batches_per_rank() if isinstance(batches, ShardBatchSampler) else None


def set_epoch(loader: Any, epoch: int) -> None:
    """The epoch for the loader's samplers and, as Accelerate and HuggingFace's Trainer do, for an iterable dataset
    with `set_epoch` (a HuggingFace `IterableDataset` reshuffles by it, and applies a restored state only in the
    epoch it was saved in)."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(epoch)
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
            raise ValueError(f"{argument}={limit} needs a loader with a length; give an int number of batches")
        return int(available * limit)
    return limit if available is None else min(limit, available)


def stop_workers(loader: Any) -> None:
    """Stop the worker processes a loader keeps after an iteration stopped, as Lightning does when a stage ends:
    those of `persistent_workers=True`, and those of the iterator torchdata's StatefulDataLoader keeps (for its
    `state_dict`) when fit stopped in the middle of an epoch, persistent or not. Left to the garbage collector,
    the iterator that holds them is finalized at whatever allocation comes next, on one rank only, and its
    shutdown joins the workers there (seconds per worker): in a multi-rank run that rank can block while the
    others wait for it in a collective. Anything else (no workers, not a DataLoader) is left alone; a later
    iteration starts new workers. `loader` may be a list or tuple of loaders."""
    for one in loader if isinstance(loader, (list, tuple)) else [loader]:
        iterator = getattr(one, "_iterator", None)  # (torch's and torchdata's DataLoader keep it here)
        if hasattr(iterator, "_shutdown_workers"):  # (a worker-less iterator has none)
            iterator._shutdown_workers()
            one._iterator = None
