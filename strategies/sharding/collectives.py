"""Stateless collective calls on flat buffers, each one counted.

Counts are elements each rank sends, by the textbook ring algorithm: an all-reduce of n elements sends about 2n,
an all-gather producing n elements about n, a reduce-scatter of an n-element input about n. Invariant 3 of the
design is checked against these counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

Work = Any  # torch.distributed.Work, or None for a finished call


class CommStats:
    """Elements sent per collective kind since the last reset."""

    def __init__(self) -> None:
        self.elements: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def add(self, kind: str, elements: int) -> None:
        self.elements[kind] += elements
        self.calls[kind] += 1

    def reset(self) -> None:
        self.elements.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.elements.values())


def _alone(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def all_reduce_mean(buffer: torch.Tensor, group: Any, stats: CommStats, async_op: bool) -> Work:
    """Sum `buffer` across ranks in place (the caller divides by the world size)."""
    if _alone(group):
        return None
    stats.add("all_reduce", 2 * buffer.numel())
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduce_scatter_sum(
    shard: torch.Tensor, full: torch.Tensor, group: Any, stats: CommStats, async_op: bool
) -> Work:
    """Sum `full` across ranks and leave this rank's slice in `shard`."""
    if _alone(group):
        shard.copy_(full)
        return None
    stats.add("reduce_scatter", full.numel())
    return dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: Any, stats: CommStats, async_op: bool) -> Work:
    """Concatenate every rank's `shard` into `full`."""
    if _alone(group):
        full.copy_(shard)
        return None
    stats.add("all_gather", full.numel())
    return dist.all_gather_single(full, shard, group=group, async_op=async_op)


def wait(work: Work) -> None:
    if work is not None:
        work.wait()
