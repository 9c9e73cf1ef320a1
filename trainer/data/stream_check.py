"""A training stream that is not split across the ranks: an iterable dataset (or a loader the Trainer did not give a
sampler) hands every rank the same batches, so N ranks train on N copies of the same data, and nothing fails. The
first training step compares a digest of each rank's first batch (one small gather, then never again) and warns
once when every rank has the same one.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, DistributedSampler

from .loaders import ShardBatchSampler


def split_by_the_trainer(loader: Any) -> bool:
    """Whether the loader's data is split by rank by a sampler (the Trainer's, or a DistributedSampler)."""
    if not isinstance(loader, DataLoader):
        return False
    if isinstance(loader.batch_sampler, ShardBatchSampler):
        return True
    inner = getattr(loader.batch_sampler, "sampler", None)
    return isinstance(loader.sampler, DistributedSampler) or isinstance(inner, DistributedSampler)


def batch_digest(batch: Any) -> int:
    """A digest of a batch's contents: its tensors' dtypes, shapes and bytes, and the text of anything else."""
    digest = hashlib.blake2b(digest_size=8)
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    return int.from_bytes(digest.digest(), "little")


def warn_if_unsplit(strategy: Any, loader: Any, batch: Any) -> None:
    """On the first training batch: warn (rank 0) when every rank has the same one. Collective where it checks."""
    if not strategy.distributed or split_by_the_trainer(loader):
        return
    digests = strategy.all_gather_object(batch_digest(batch))
    per_data_rank = [digests[r] for r in strategy.data_parallel_representatives()]  # a tp/cp/pp group reads one
    if strategy.is_global_zero and strategy.data_parallel_size > 1 and len(set(per_data_rank)) == 1:
        warnings.warn(
            f"every one of the {strategy.world_size} ranks got the same first training batch: the training data "
            "is not split by rank, so each rank trains on a copy of the same data. Split the stream by rank: "
            "datasets.distributed.split_dataset_by_node(dataset, rank=trainer.global_rank, "
            "world_size=trainer.world_size) for a HuggingFace IterableDataset; in an IterableDataset of your own, "
            "read only this rank's part (as DistributedSampler does for map-style data: every world_size-th item "
            "from the rank's index); or give a map-style dataset to the Trainer with use_distributed_sampler=True",
            stacklevel=3,
        )
