"""Training data that runs out at different times on different ranks (evaluation: trainer/evaluation/steps.py).

Training from an iterable dataset: a step needs every rank's gradient, so the epoch ends on every rank as soon as
the first rank runs out (the loop learns it in the all-reduce it makes after each training_step), and rank 0 says
how many batches each rank left unused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

_END = object()
_COUNT_LEFT_CAP = 10_000  # batches a rank counts when it reports what it left unused


class Lookahead:
    """Iterates a loader one batch ahead, so that `has_next` says whether this rank has another batch. Used for
    loaders without a length; a loader with one needs no look ahead (the batch index says it).

    With a `position` (loader_state.LoaderPosition) whose loader keeps its own state, that state is taken after
    each batch is read, before the next one, and handed on with the batch: a checkpoint then holds the state after
    the batch trained, not after the one read ahead."""

    def __init__(self, loader: Iterable, position: Any = None) -> None:
        self._position = position if position is not None and position.target is not None else None
        self._iterator = iter(loader)
        self._next = next(self._iterator, _END)
        self._next_state = self._state()
        self._closed = False

    def _state(self) -> Any:
        return self._position.capture() if self._position is not None else None

    @property
    def has_next(self) -> bool:
        return self._next is not _END

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._closed or self._next is _END:
            raise StopIteration
        batch, state = self._next, self._next_state
        if self._position is not None:
            self._position.taken(state)
        self._next = next(self._iterator, _END)
        self._next_state = self._state() if self._next is not _END else None
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
