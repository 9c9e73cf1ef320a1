"""The contract between the checkpoint component and each owner of state, as torch's `Stateful`
(`torch.distributed.checkpoint.stateful`): `state_dict()` is what the owner writes, `load_state_dict(state_dict)`
takes back what was read. Each owner implements it where it lives: the engine (the model's and optimizers'
shards, strategies/sharding/state_dict.py), the trainer state, the loaders' position, the RNG states, callbacks.
The component (checkpointer.py) calls down into the owners and never back up; which owners a checkpoint holds,
under which keys, is its caller's map (the Trainer's, or a plain loop's `strategy.save`).

An owner's state is stored in one of three ways:

- whole, by rank 0 (any `Stateful`): a scheduler, the trainer state; every rank reads it whole;
- one per rank (`PerRank`): each rank writes its own, and reads the one `source_rank` names under the
  checkpoint's world size, or every saved rank's as a dict by rank (RNG states, a loader's position);
- as pieces (`ShardedState`): each rank writes its own pieces of large tensors (`FlatPieces`; whole tensors from
  rank 0) and reads in place only the chunks that overlap the pieces it holds now, under any strategy and world
  size (the model's and optimizers' shards, an average of the weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["PerRank", "ShardedState", "Stateful", "is_sharded"]


@runtime_checkable
class ShardedState(Protocol):
    """An owner whose state each rank writes and reads in pieces."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces: a nested dict of `FlatPieces`, tensors and plain values."""

    def load_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        """Where this rank reads, filled in place: a nested dict of `FlatPieces` and tensors, keyed as
        `state_dict` keys them. `saved` is what the checkpoint holds under the owner's key, tensors as meta
        tensors of the saved shape and dtype, other values as they are."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called with the filled targets, once every owner's are filled."""


def is_sharded(owner: Any) -> bool:
    return isinstance(owner, ShardedState)


class PerRank:
    """An owner of which every rank writes its own state, under `<key>.<rank>`.

    Args:
        owner: the state's owner; its `state_dict()` may return None (nothing to write now).
        rank: this rank.
        source_rank: the rank whose saved state this rank reads, given the checkpoint's world size (None: none;
            a list of ranks: each of their states, as a dict by rank, those a rank wrote).
    """

    def __init__(self, owner: Stateful, rank: int, source_rank: Callable[[int], int | list[int] | None]) -> None:
        self.owner, self.rank, self.source_rank = owner, rank, source_rank

    def state_dict(self) -> Any:
        return self.owner.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.owner.load_state_dict(state_dict)
