"""An epoch's training batches from a given batch on: all of them, or those after a mid-epoch resume.

The sampler the Trainer built starts there (resume_sampler.py), and a loader that keeps its own state gets the
checkpoint's (loader_state.py); the random state is the checkpoint's from the first batch on (making the iterator,
and reading one batch ahead, draw from it). Any other loader has the skipped batches loaded and dropped. A loader
without a length (an iterable dataset, whose ranks may run out at different times) is looked ahead (uneven.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..seed import rng_state, set_rng_state
from .loader_state import unsaved_buffer
from .loaders import loader_length
from .resume_sampler import start_at_batch
from .uneven import Lookahead

if TYPE_CHECKING:
    from ..trainer import Trainer


def epoch_batches(trainer: Trainer, loader: Any, skip: int) -> tuple[Any, Iterator[tuple[int, Any]], bool]:
    """(this epoch's batch source, its (batch_idx, batch) from batch `skip` on, whether the epoch is empty on every
    rank because some rank has no batch at all). `skip` is the number of batches trained before a resume; a
    resume after the epoch's last batch has none left to read."""
    if trainer.state.epoch_complete:
        return loader, iter(()), False
    resume_rng = rng_state() if skip else None  # the checkpoint's
    source = trainer.loader_position.epoch_source(loader)  # a resumed stream's remainder (stream_remainder.py)
    restored = source is not loader or (bool(skip) and trainer.loader_position.restore())
    empty = False
    if source is not loader or loader_length(loader) is None:
        batches: Any = Lookahead(source, trainer.loader_position)
        strategy = trainer.strategy
        if strategy.distributed and not strategy.reduce_boolean_decision(batches.has_next):
            batches.close()  # some rank has no batch at all: the epoch is empty on every rank
            empty = True
        starts_there = restored
    else:
        starts_there = restored or (bool(skip) and start_at_batch(loader, skip))
        batches = iter(loader) if starts_there else loader
    if starts_there:
        set_rng_state(resume_rng)
        return batches, enumerate(batches, start=skip), empty
    if skip and not _split_changed(trainer):  # (if it did, global_batch.py said what the resume does)
        _warn_loading_skipped(loader, skip)
    return batches, _skipping(enumerate(batches), skip, resume_rng), empty


def _skipping(batches: Iterator[tuple[int, Any]], skip: int, resume_rng: dict | None) -> Iterator[tuple[int, Any]]:
    """`batches` from batch `skip` on, the skipped ones loaded and dropped; the random state is set back to the
    checkpoint's once they are (loading them drew from it)."""
    for batch_idx, batch in batches:
        if batch_idx < skip:
            if batch_idx == skip - 1:
                set_rng_state(resume_rng)
            continue
        yield batch_idx, batch


def _split_changed(trainer: Trainer) -> bool:
    """Whether the resumed checkpoint's run split the data over another number of ranks."""
    saved = trainer.resumed_layout
    return saved is not None and saved["ranks"] != trainer.data_layout.ranks


def _warn_loading_skipped(loader: Any, skip: int) -> None:
    """A mid-epoch resume with a loader the Trainer did not build loads the trained batches again to skip them;
    with workers, their random state then differs from the uninterrupted run's."""
    workers = getattr(loader, "num_workers", 0)
    buffer = unsaved_buffer(loader)
    if buffer is not None:
        warnings.warn(
            f"resuming in the middle of an epoch: the training stream's {buffer} is not part of its state, so a "
            "resume from that state would never train the rows waiting in the buffer at the checkpoint. The epoch "
            f"is read again from its start instead and the {skip} batches already trained are skipped, which is "
            "exact (the shuffle is seeded): it costs the time to load them again",
            stacklevel=3,
        )
        return
    warnings.warn(
        f"resuming in the middle of an epoch: the {skip} batches already trained are loaded again to skip them, "
        "since the training loader's sampler is not one the Trainer built (a DataLoader with a sampler of your "
        "own, use_distributed_sampler=False, or an iterable dataset) and the checkpoint holds no state of the "
        "loader's own to restore (give a stream to torchdata's StatefulDataLoader, or resume with "
        "restore_loader_state=True at the checkpoint's world size, to read on where it was)"
        + (
            f"; with num_workers={workers}, random augmentation in the workers then differs from an uninterrupted run"
            if workers
            else ""
        ),
        stacklevel=3,
    )
