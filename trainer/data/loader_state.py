"""The training loader's own position, saved per rank with each checkpoint and restored on resume, for loaders that
keep one: torchdata's `StatefulDataLoader`, or a `DataLoader` without workers over an iterable dataset with
`state_dict()` / `load_state_dict()` (a HuggingFace `IterableDataset`, the user's own). A resumed run then reads on
from where the checkpoint was, instead of loading the epoch's trained batches again to skip them.

A map-style loader the Trainer rebuilt with its own sampler keeps its position as a batch count (resume_sampler.py):
that one works at any world size (global_batch.py). A stream whose state leaves out rows it holds (a HuggingFace
shuffle buffer) keeps no state either: restored, the rows in the buffer at the checkpoint would never be trained, so
a resume reads the epoch again and skips the batches trained, which is exact (the shuffle is seeded by the epoch).
A loader's own state is per rank, so it is restored only at the world size that saved it (LitData's and MosaicML's,
which hold the global position, at any; a split HuggingFace stream's becomes the old ranks' remainders, dealt out:
stream_remainder.py); at another, `fit(..., restore_loader_state=False)` re-reads the epoch's data from its start
instead.

The state is stored as plain Python types and tensors (NumPy arrays and scalars converted), so that a checkpoint
reads back with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import IterableDataset

from .resume_sampler import ResumableSampler

LOADER_STATE_ARGUMENT = "restore_loader_state"


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_part(loader: Any) -> Any | None:
    """What holds `loader`'s position in its `state_dict()`: the loader itself, or (without workers, whose copies
    of the dataset the main process cannot see) its iterable dataset; None when neither does, or when the position
    is the Trainer's own sampler's."""
    if isinstance(getattr(loader, "sampler", None), ResumableSampler) or unsaved_buffer(loader) is not None:
        return None
    if _has_state(loader):
        return loader
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and _has_state(dataset) and getattr(loader, "num_workers", 0) == 0:
        return dataset
    return None


def unsaved_buffer(loader: Any) -> str | None:
    """What `loader`'s stream holds outside its `state_dict()`, described, or None: a HuggingFace `IterableDataset`
    shuffled through a buffer (`.shuffle(buffer_size=...)`) saves where its shards were read, not the rows waiting
    in the buffer, and datasets refills the buffer on a restore, so those rows are lost."""
    pending = [getattr(getattr(loader, "dataset", None), "_ex_iterable", None)]  # datasets' chain of iterables
    while pending:
        node = pending.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return f"HuggingFace shuffle buffer (buffer_size={node.buffer_size})"
        pending += [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
    return None


def plain(value: Any) -> Any:
    """`value` in plain types (dicts, lists, tuples, numbers, strings, None, tensors): NumPy arrays as lists and
    NumPy scalars as Python numbers; anything else is kept as it is."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value).__module__ == "numpy":
        return value.tolist() if hasattr(value, "tolist") else value
    return value


class LoaderPosition:
    """The training loader's state after the latest batch the loop took from it, and the state a checkpoint
    restores into it."""

    def __init__(self) -> None:
        self.target: Any = None  # what holds the position (stateful_part)
        self.pending: dict | None = None  # a checkpoint's state, loaded into the target when its epoch starts
        self.pending_from: tuple[str, int] | None = None  # (the checkpoint, its world size) when pending
        self._taken: dict | None = None  # state after the latest batch taken, when batches are looked ahead
        self.remainder: Any = None  # what the resumed epoch reads instead of the loader (stream_remainder.py)

    def attach(self, loader: Any) -> None:
        self.target, self._taken = stateful_part(loader), None

    def epoch_source(self, loader: Any) -> Any:
        """What this epoch reads, its position followed from here: a resumed epoch's remainder (once), else the
        loader."""
        if self.remainder is not None:
            source, self.remainder = self.remainder, None
            self.target, self._taken = source, None
            return source
        self.attach(loader)  # (after a remainder's epoch, the loader again)
        return loader

    def capture(self) -> dict | None:
        """The target's state now, copied (a loader may change the dicts it returns as it reads on)."""
        return None if self.target is None else copy.deepcopy(self.target.state_dict())

    def taken(self, state: dict | None) -> None:
        """The state after the latest batch handed to the loop, where the loop reads one batch ahead."""
        self._taken = state

    def keep(self) -> None:
        """Hold the target's state as it is now, for checkpoints saved later: before a loader's iterator (which
        holds a StatefulDataLoader's state) is dropped at the end of fit."""
        if self.target is not None and self._taken is None:
            self._taken = self.capture()

    def saved(self) -> dict | None:
        """What a checkpoint stores: the state after the latest batch taken (in plain types), or None."""
        if self.target is None:
            return None
        return plain(self._taken if self._taken is not None else self.target.state_dict())

    def state_dict(self) -> dict | None:
        """A checkpoint's per-rank entry (strategies/checkpoint/stateful.py): what `saved` says."""
        return self.saved()

    def load_state_dict(self, state_dict: dict | None) -> None:
        """Hold a checkpoint's states, every saved rank's by rank, until the loader is built (`check_world_size`
        keeps this rank's) and its epoch starts (`restore`)."""
        self.pending = state_dict

    def restore(self) -> bool:
        """Load a checkpoint's state into the loader (before its epoch's iteration starts); whether it did."""
        state, self.pending = self.pending, None
        if state is None or self.target is None:
            return False
        self.target.load_state_dict(state)
        return True


ELASTIC_LOADERS = {("litdata", "StreamingDataLoader"), ("streaming", "StreamingDataLoader")}


def resumes_on_any_world_size(loader: Any) -> bool:
    """Whether `loader`'s own state resumes on another number of ranks: LitData's and MosaicML's
    `StreamingDataLoader`, whose state holds the stream's global position (every rank's is alike) and which resume
    it without repeating a sample on a new number of ranks or workers (their elastic resume)."""
    kind = (type(loader).__module__.split(".")[0], type(loader).__name__)
    return kind in ELASTIC_LOADERS and _has_state(loader)


def check_world_size(position: LoaderPosition, world_size: int, rank: int, loader: Any) -> None:
    """Keep this rank's state of a checkpoint's loader states (`position.pending`, by rank). Per-rank state
    resumes at its own world size only, unless the loader's state resumes anywhere: then this rank takes an old
    rank's. (A split HuggingFace stream on another number of ranks: stream_remainder.py.)"""
    path, saved_world_size = position.pending_from
    if saved_world_size in (None, world_size):
        position.pending = position.pending.get(rank)
    elif resumes_on_any_world_size(loader):
        position.pending = position.pending.get(rank % saved_world_size)
    else:
        raise ValueError(
            f"ckpt_path={path!r} holds the training loader's own state of each of its {saved_world_size} ranks "
            f"(where each rank's stream was), and this run has {world_size}: a rank's state cannot be split or "
            f"merged onto other ranks. Choose one: resume on {saved_world_size} ranks, or pass "
            f"fit(..., {LOADER_STATE_ARGUMENT}=False) to read this epoch's data again from its start (split over "
            f"{world_size} ranks) and skip the batches already trained"
        )
