"""The rest of an epoch of a HuggingFace stream split by node (`split_dataset_by_node`), read on another number of
data-parallel ranks than the checkpoint's.

A stream splits itself by rank, so what one old rank had left cannot be described in the datasets state of a new
rank: growing, an old rank's shards go to several new ranks; shrinking, a new rank would resume two partly read
shards at once. What each old rank had left is known exactly, though: its own stream (the dataset split for that
old rank), resumed from its saved state, or for a stream whose state leaves rows out (a shuffle buffer) read from
the epoch's start with the batches trained skipped, which is exact as the shuffle is seeded by the epoch. Those
remainders are the epoch's "parts", one per old rank, and they are dealt out to the new ranks:

- fewer ranks: new rank `n` reads the parts of the old ranks `o` with `o % new == n`, a batch of each in turn;
- more ranks: the parts' batches are dealt in turn to the new ranks `n` with `n % old == o`.

With `global_batch_size` kept, an optimizer step then accumulates the batches the checkpoint's run would have
stepped on together, so the run goes on as uninterrupted, up to the order of floating-point sums.

Every remaining sample of the epoch is trained once (where an old rank's part is not a multiple of the new ranks
sharing it, the last batches are left, and said: uneven.py). The next epoch reads the stream as split for this run.

A checkpoint inside such an epoch holds the parts, each as (the saved state it started from, the batches of it
read since), so a resume from it, on any number of ranks, deals the same parts out again.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader

from .loader_state import LOADER_STATE_ARGUMENT, stateful_part
from .loaders import like

_END = object()
KEY = "stream_remainder"  # marks a checkpoint's loader entry written inside such an epoch


@dataclasses.dataclass(frozen=True)
class Part:
    """An old rank's stream: from `state` (its saved datasets or loader state; None: the epoch's start) on, with
    the first `skip` batches after that already trained."""

    state: Any
    skip: int


def split_stream(loader: Any) -> Any | None:
    """`loader`'s HuggingFace `IterableDataset` when it is split by node (`split_dataset_by_node`), else None."""
    dataset = getattr(loader, "dataset", None)
    if type(dataset).__module__.split(".")[0] != "datasets" or not hasattr(dataset, "load_state_dict"):
        return None
    return dataset if getattr(dataset, "_distributed", None) is not None else None


def is_remainder_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and KEY in entry


def parts_from_checkpoint(
    entries: dict[int, Any], world_size: int, ranks: int, batches_done: int
) -> tuple[int, dict[int, Part]]:
    """(the old data-parallel ranks, the epoch's parts by old rank) from a checkpoint of `world_size` ranks of which
    `ranks` read data (the others are tensor-parallel ranks of theirs, holding the same position) after
    `batches_done` batches of the epoch. `entries`: the loader entries the checkpoint holds, by global rank (none:
    a stream that keeps no state, read again from the epoch's start)."""
    remainders = [entry[KEY] for entry in entries.values() if is_remainder_entry(entry)]
    if remainders:  # written inside an epoch that was itself a remainder: its parts, as they stand
        parts = {}
        for remainder in remainders:
            parts.update({old: Part(**part) for old, part in remainder["parts"].items()})
        return remainders[0]["ranks"], parts
    per_rank = world_size // ranks  # global ranks of one data-parallel rank
    return ranks, {old: Part(entries.get(old * per_rank), 0 if entries else batches_done) for old in range(ranks)}


def remainder_to_read(trainer: Any, loader: Any) -> StreamRemainder | None:
    """The rest of the epoch this rank reads, when `trainer` resumed inside an epoch of a split HuggingFace stream
    on another number of data-parallel ranks than the checkpoint's, or from a checkpoint written inside such a
    rest; else None (the loader's own state, or the batches skipped, say where the epoch goes on)."""
    position, state, saved = trainer.loader_position, trainer.state, trainer.resumed_layout
    if saved is None or state.epoch_complete or not state.batches_done_in_epoch or split_stream(loader) is None:
        return None
    path, saved_world_size = position.pending_from
    strategy = trainer.strategy
    entries = position.pending or {}  # every saved rank's, by rank
    continued = any(is_remainder_entry(entry) for entry in entries.values())
    if not continued and (saved["ranks"] == strategy.data_parallel_size or not trainer.restore_loader_state):
        return None
    if continued and not trainer.restore_loader_state:
        raise ValueError(
            f"ckpt_path={path!r} stopped inside an epoch that was itself resumed on another number of ranks; its "
            f"position is only in the loader state it saved: resume it with {LOADER_STATE_ARGUMENT}=True"
        )
    _check_split(split_stream(loader), strategy)
    old_ranks, parts = parts_from_checkpoint(entries, saved_world_size, saved["ranks"], state.batches_done_in_epoch)
    position.pending = None
    return StreamRemainder(loader, parts, old_ranks, strategy.data_parallel_size, strategy.data_parallel_rank)


def _check_split(dataset: Any, strategy: Any) -> None:
    """The stream must be split as this run splits its data, so that it can be split for the old ranks too."""
    split = dataset._distributed
    if (split.rank, split.world_size) != (strategy.data_parallel_rank, strategy.data_parallel_size):
        raise ValueError(
            f"the training stream is split by node for rank {split.rank} of {split.world_size}, and this run's "
            f"rank reads data as rank {strategy.data_parallel_rank} of {strategy.data_parallel_size}: split it "
            "with split_dataset_by_node(dataset, rank=trainer.global_rank, world_size=trainer.world_size) "
            "(under tensor parallel, the data-parallel rank and size) to resume it on another number of ranks"
        )


def old_ranks_of(parts: int, ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """The parts data-parallel `rank` of `ranks` reads: (old rank, its turn, the ranks sharing it)."""
    if ranks < parts:
        return [(old, 0, 1) for old in range(parts) if old % ranks == rank]
    sharing = len(range(rank % parts, ranks, parts))
    return [(rank % parts, rank // parts, sharing)]


class StreamRemainder:
    """This rank's batches of the parts of an epoch (see above), and its position in them for a checkpoint."""

    def __init__(self, loader: Any, parts: dict[int, Part], old_ranks: int, ranks: int, rank: int) -> None:
        self.loader, self.parts, self.old_ranks = loader, parts, old_ranks
        self.mine = old_ranks_of(old_ranks, ranks, rank)
        self.taken = {old: 0 for old, _, _ in self.mine}  # batches this rank took of each part

    def __iter__(self) -> Iterator[Any]:
        """A batch of each of this rank's parts in turn, so that the batches an optimizer step accumulates are
        those the checkpoint's run stepped on together (with the same global batch)."""
        streams = {old: self._dealt(old, turn, sharing) for old, turn, sharing in self.mine}
        while streams:
            for old, stream in list(streams.items()):
                batch = next(stream, _END)
                if batch is _END:
                    del streams[old]
                    continue
                self.taken[old] += 1
                yield batch

    def _dealt(self, old: int, turn: int, sharing: int) -> Iterator[Any]:
        """The batches of old rank `old`'s part this rank takes: every `sharing`-th from its `turn` on."""
        rest = islice(self._stream_of(old), self.parts[old].skip, None)
        return (batch for index, batch in enumerate(rest) if index % sharing == turn)

    def _stream_of(self, old: int) -> Any:
        """Old rank `old`'s stream, at its part's saved state."""
        dataset = split_stream(self.loader)
        distributed = dataclasses.replace(dataset._distributed, rank=old, world_size=self.old_ranks)
        old_dataset = copy.deepcopy(dataset)  # (a restore changes the iterables the dataset holds)
        old_dataset._distributed = distributed  # the split datasets would make for that rank
        state = self.parts[old].state
        if not isinstance(self.loader, DataLoader):
            raise ValueError(
                "a HuggingFace stream resumed on another number of ranks is read through a DataLoader or "
                f"torchdata's StatefulDataLoader; the training loader is a {type(self.loader).__name__}"
            )
        batching = {"batch_size": self.loader.batch_size, "drop_last": self.loader.drop_last}
        old_loader = like(self.loader, old_dataset, _saved_workers(state), persistent=False, **batching)
        if state is not None:
            stateful_part(old_loader).load_state_dict(state)
        return old_loader

    @staticmethod
    def batches_done(saved: Any, now: Any, batches_done: int) -> int:
        """The batches of this run's size (data_layout) the samples trained before the checkpoint make: where the
        resumed epoch counts its batches from (the samples themselves are the parts')."""
        if None in (saved.batch_size, now.batch_size):
            return batches_done
        return max(1, batches_done * saved.batch_size * saved.ranks // (now.batch_size * now.ranks))

    def state_dict(self) -> dict:
        """The parts this rank reads, each at the batches taken of it by all the ranks sharing it (they take one
        each in turn, so as many as this rank times their number)."""
        parts = {}
        for old, _, sharing in self.mine:
            part = self.parts[old]
            parts[old] = {"state": part.state, "skip": part.skip + self.taken[old] * sharing}
        return {KEY: {"ranks": self.old_ranks, "parts": parts}}


def _saved_workers(state: Any) -> int | None:
    """The workers of the StatefulDataLoader whose state `state` is (None: not one's), which it must have again to
    load it."""
    if not isinstance(state, dict) or "_iterator_finished" not in state:
        return None
    return len(state["_snapshot"]["_worker_snapshots"]) if "_snapshot" in state else 0
