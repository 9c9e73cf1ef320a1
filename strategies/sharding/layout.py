"""Where every parameter lives in a unit's flat buffer, and which slice of it each rank owns.

A unit's parameters are laid end to end in one flat buffer, padded at the end to a multiple of the world size.
Rank r owns the contiguous slice [r * shard_size, (r + 1) * shard_size). The unsharded parameters are views into
the flat buffer, so an all-gather writes them directly; a replicated gradient bucket of the same layout is
all-reduced in place, and sharded gradients are sent piece by piece (`pieces`) to the ranks that own them.
A parameter may straddle two ranks' slices: each rank then holds a piece of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns: flattened-parameter range and where it sits in the shard."""

    param_index: int
    start: int  # first element of the flattened parameter held by this rank
    end: int  # one past the last
    shard_offset: int  # where that range begins inside the rank's shard

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Offsets of a list of parameters in a flat buffer split evenly across `world_size` ranks."""

    def __init__(self, shapes: list[torch.Size], world_size: int) -> None:
        self.shapes = list(shapes)
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.world_size = world_size
        self.total = total
        self.shard_size = -(-total // world_size) if total else 0
        self.padded_total = self.shard_size * world_size

    @property
    def padding(self) -> int:
        return self.padded_total - self.total

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty pieces of parameters that `rank` owns, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(lo, off), min(hi, off + n)
            if start < end:
                out.append(Piece(i, start - off, end - off, start - lo))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full-shape view into an unsharded flat buffer."""
        return [
            flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]
