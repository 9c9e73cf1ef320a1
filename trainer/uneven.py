"""Ranks whose data runs out at different times.

Evaluation sees every sample once: each rank takes a contiguous share without padding (data.ShardSampler), so one
rank may have a batch more than another, and an iterable dataset may give each rank any number. Yet every rank must
run the same number of steps: under fsdp each forward pass all-gathers parameters from every rank, and a metric
logged with sync_dist all-reduces. So a rank that has run out keeps stepping on a filler batch (one sample of its
last batch) until the last rank is done; those steps' logs weigh nothing and their outputs and batch-end hooks are
dropped. One real sample rather than none, because models cannot take a batch of 0 samples (GPT's and
HuggingFace's attention reshape with -1, which is ambiguous for 0 elements); what a step accumulates itself (a list
in the module, a metric object) does see the repeat, so results are best collected in on_*_batch_end.

Training from an iterable dataset: a step needs every rank's gradient, so the epoch ends on every rank as soon as
the first rank runs out (the loop learns it in the all-reduce it makes after each training_step), and rank 0 says
how many batches each rank left unused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .agreement import count_across_ranks
from .data import batches_per_rank, loader_length

_END = object()
_COUNT_LEFT_CAP = 10_000  # batches a rank counts when it reports what it left unused


class Lookahead:
    """Iterates a loader one batch ahead, so that `has_next` says whether this rank has another batch. Used for
    loaders without a length; a loader with one needs no look ahead (the batch index says it)."""

    def __init__(self, loader: Iterable) -> None:
        self._iterator = iter(loader)
        self._next = next(self._iterator, _END)
        self._closed = False

    @property
    def has_next(self) -> bool:
        return self._next is not _END

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._closed or self._next is _END:
            raise StopIteration
        batch, self._next = self._next, next(self._iterator, _END)
        return batch

    def close(self) -> None:
        """End the iteration here; the batches not taken count as left."""
        self._closed = True

    def count_left(self, cap: int = _COUNT_LEFT_CAP) -> int:
        """Take the batches left (at most `cap`) and count them."""
        left = 0
        while self.has_next and left < cap:
            self._next = next(self._iterator, _END)
            left += 1
        return left


def report_unused(batches: Lookahead, strategy: Any, epoch: int, trained: int) -> None:
    """After an epoch that ended because some rank ran out: rank 0 says how many batches each rank left.
    Collective."""
    left = strategy.all_gather_object(batches.count_left())
    if not strategy.is_global_zero or not any(left):
        return
    counts = ", ".join(f"rank {r}: {n}{'+' * (n >= _COUNT_LEFT_CAP)}" for r, n in enumerate(left))
    warnings.warn(
        f"epoch {epoch} ended after {trained} batches, when the training data of rank(s) "
        f"{[r for r, n in enumerate(left) if n == 0]} ran out (a step needs every rank); batches left unused: "
        f"{counts}. Give every rank the same number of batches (an IterableDataset must split its data evenly "
        "across ranks).",
        stacklevel=2,
    )


def evaluation_batches(loader: Any, limit: int, strategy: Any) -> Iterator[tuple[Any, bool]]:
    """(batch, True) while this rank has data, then (filler batch, False) until every rank is done, for at most
    `limit` steps: the same number of steps on every rank. For a split map-style dataset every rank knows how many
    batches each has; for a loader without a length the ranks tell each other at every step (one all-reduce)."""
    counts = batches_per_rank(loader)
    steps = min(limit, max(counts)) if counts is not None else limit
    exchange = strategy.distributed and counts is None and loader_length(loader) is None
    iterator, template = iter(loader), None
    for _ in range(steps):
        batch = next(iterator, _END)
        has_batch = batch is not _END
        if exchange:
            have, lack_template = _tell_each_other(strategy, has_batch, template is None)
            if have == 0:
                return
            if lack_template:
                template = _template_from_peers(strategy, batch if has_batch else None, template)
        elif not has_batch and counts is None:
            return
        if has_batch:
            template = batch
            yield batch, True
        else:
            yield one_sample(template if template is not None else _first_sample(loader)), False


def _tell_each_other(strategy: Any, has_batch: bool, no_template: bool) -> tuple[int, bool]:
    """(ranks that have a batch, whether a rank without one has never had a batch to cut). Collective."""
    have, lacking_template = count_across_ranks(strategy, (has_batch, not has_batch and no_template))
    return have, lacking_template > 0


def _template_from_peers(strategy: Any, batch: Any, template: Any) -> Any:
    """A batch to cut for a rank that never had one: another rank's current batch. Collective; at most once per
    rank and evaluation."""
    offered = strategy.all_gather_object(batch)
    if template is not None or batch is not None:
        return template if template is not None else batch
    return next(b for b in offered if b is not None)


def _first_sample(loader: Any) -> Any:
    """A one-sample batch of a map-style dataset, for a rank whose share is empty."""
    return loader.collate_fn([loader.dataset[0]])


def one_sample(batch: Any) -> Any:
    """`batch` cut to its first sample: every tensor with a batch dimension keeps its other dimensions."""
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)
