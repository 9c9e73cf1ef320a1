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


# gloo's reduce-scatter is a clone, a full all-reduce and a copy, so an all-reduce whose local slice we keep is
# about twice as fast; and its collectives slow down above a few tens of MiB, so large ones go in chunks.
GLOO_CHUNK_BYTES = 16 * 2**20


class Pending:
    """Several in-flight works, and what to do once all are done."""

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()
        if self.then is not None:
            self.then()
            self.then = None


def _alone(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def _on_gloo(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


def _chunks(numel: int, element_size: int) -> list[tuple[int, int]]:
    step = max(1, GLOO_CHUNK_BYTES // element_size)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def all_reduce_sum(buffer: torch.Tensor, group: Any, stats: CommStats, async_op: bool) -> Work:
    """Sum `buffer` across ranks in place (callers divide by the world size)."""
    if _alone(group):
        return None
    stats.add("all_reduce", 2 * buffer.numel())
    pieces = _chunks(buffer.numel(), buffer.element_size()) if _on_gloo(group) else [(0, buffer.numel())]
    works = [dist.all_reduce(buffer[a:b], group=group, async_op=True) for a, b in pieces]
    pending = Pending(works)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: Any, stats: CommStats, async_op: bool) -> Work:
    """Sum `full` across ranks and leave this rank's slice in `shard` (`full` may be overwritten)."""
    if _alone(group):
        shard.copy_(full)
        return None
    if _on_gloo(group):
        rank = dist.get_rank(group)
        work = all_reduce_sum(full, group, stats, async_op=True)
        pending = Pending([work], lambda: shard.copy_(full[rank * shard.numel() : (rank + 1) * shard.numel()]))
    else:
        stats.add("reduce_scatter", full.numel())
        pending = Pending([dist.reduce_scatter_single(shard, full, group=group, async_op=True)])
    if not async_op:
        pending.wait()
    return pending


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: Any, stats: CommStats, async_op: bool) -> Work:
    """Concatenate every rank's `shard` into `full`."""
    if _alone(group):
        full.copy_(shard)
        return None
    stats.add("all_gather", full.numel())
    size, n = dist.get_world_size(group), shard.numel()
    if _on_gloo(group) and full.numel() * full.element_size() > GLOO_CHUNK_BYTES:
        # Chunk by chunk, each rank's piece of a chunk lands straight in its place in `full`.
        works = []
        for a, b in _chunks(n, shard.element_size() * size):
            outputs = [full[r * n + a : r * n + b] for r in range(size)]
            works.append(dist.all_gather(outputs, shard[a:b], group=group, async_op=True))
        pending = Pending(works)
    else:
        pending = Pending([dist.all_gather_single(full, shard, group=group, async_op=True)])
    if not async_op:
        pending.wait()
    return pending


def wait(work: Work) -> None:
    if work is not None:
        work.wait()
