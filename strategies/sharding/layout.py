"""Where every parameter lives in a unit's flat buffer, and which slices of it each rank owns.

A unit's parameters are laid end to end in one flat buffer, in segments: its trainable parameters first, then its
frozen ones (one segment when they are all of a kind). Each segment is padded to a multiple of the world size and
split evenly: rank r owns the r-th of its N equal chunks, and its shard is its chunks of every segment, end to end.
Splitting each kind on its own keeps a few small trainable tensors (LoRA adapters beside a frozen base) from all
landing in one rank's slice: every rank holds about 1/N of the trainable elements, and so of the optimizer state
and of the step's work. The gradient shard covers the trainable segment only (the start of the shard).

The unsharded parameters are views into the flat buffer, so an all-gather (one per segment) writes them directly;
a replicated gradient bucket of the same layout is all-reduced in place, and sharded gradients are sent piece by
piece (`pieces`) to the ranks that own them. A parameter may straddle two ranks' chunks: each then holds a piece.

The slices a rank holds of a flattened parameter, seen as rectangular chunks of the original tensor (`FlatPieces`):
a slice [start, end) of a row-major tensor is a few rectangular boxes of it: a partial first row, a block of whole
rows and a partial last row, and so on down the dimensions (at most two per dimension and one block). Each box is
contiguous in the flat order, so it is a plain view of the slice. Checkpoints store tensors as such boxes (offsets
and sizes in the original tensor), which any other layout can read back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Segment:
    """Parameters of one kind, end to end from `start` in the flat buffer, padded to `chunk` elements per rank:
    rank r owns [start + r * chunk, start + (r + 1) * chunk), at `shard_start` in its shard."""

    params: tuple[int, ...]
    trainable: bool
    start: int
    chunk: int
    shard_start: int

    def owned(self, rank: int) -> tuple[int, int]:
        return self.start + rank * self.chunk, self.start + (rank + 1) * self.chunk


class FlatLayout:
    """Offsets of a list of parameters in a flat buffer split evenly across `world_size` ranks, each kind
    (`trainable` flags, default all trainable) in a segment of its own."""

    def __init__(self, shapes: list[torch.Size], world_size: int, trainable: list[bool] | None = None) -> None:
        self.shapes = list(shapes)
        self.numels = [s.numel() for s in self.shapes]
        self.world_size = world_size
        trainable = [True] * len(self.shapes) if trainable is None else list(trainable)
        self.offsets = [0] * len(self.shapes)
        self.segments: list[Segment] = []
        start = shard_start = 0
        for kind in (True, False):
            params = tuple(i for i, t in enumerate(trainable) if t == kind)
            if not params:
                continue
            size = 0
            for i in params:
                self.offsets[i] = start + size
                size += self.numels[i]
            chunk = -(-size // world_size)
            self.segments.append(Segment(params, kind, start, chunk, shard_start))
            start += chunk * world_size
            shard_start += chunk
        self.total = sum(self.numels)
        self.padded_total = start
        self.shard_size = shard_start
        # The gradient shard: the trainable segment's chunk, at the start of the shard.
        self.trainable_shard_size = sum(s.chunk for s in self.segments if s.trainable)

    @property
    def padding(self) -> int:
        return self.padded_total - self.total

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The one slice `rank` owns in a layout of one segment (a replicated bucket's)."""
        assert len(self.segments) <= 1, "a layout of several segments has a slice per segment (owned)"
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def owned(self, rank: int) -> list[tuple[Segment, int, int]]:
        """(segment, first, one past the last element) of each slice `rank` owns in the flat buffer."""
        return [(s, *s.owned(rank)) for s in self.segments]

    def padding_ranges(self) -> list[tuple[int, int]]:
        """The ranges of the flat buffer that hold no parameter (each segment's end)."""
        out = []
        for s in self.segments:
            used = sum(self.numels[i] for i in s.params)
            if used < s.chunk * self.world_size:
                out.append((s.start + used, s.start + s.chunk * self.world_size))
        return out

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty pieces of parameters that `rank` owns, in the order of its shard."""
        out = []
        for segment, lo, hi in self.owned(rank):
            for i in segment.params:
                off, n = self.offsets[i], self.numels[i]
                start, end = max(lo, off), min(hi, off + n)
                if start < end:
                    out.append(Piece(i, start - off, end - off, segment.shard_start + start - lo))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full-shape view into an unsharded flat buffer."""
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]


# ---- a rank's flat slices as boxes of the original tensor (what checkpoints store) --------------------------
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the original tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes that elements [start, end) of a row-major tensor of `shape` cover, in flat order."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    boxes: list[Box] = []
    row = start // inner
    if start % inner:  # a partial first row
        stop = min(end, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, start - row * inner, stop - row * inner)]
        start, row = stop, row + 1
    rows = (end - start) // inner
    if rows:  # whole rows
        boxes.append(((row, *(0 for _ in rest)), (rows, *rest)))
        start, row = start + rows * inner, row + rows
    if start < end:  # a partial last row
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, 0, end - start)]
    return boxes


def box_start(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Flat index of a box's first element."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


@dataclass
class FlatPieces:
    """Some flat slices of one tensor: what a rank writes of a tensor in a checkpoint, or the places it loads one
    into. Checkpoints store them as rectangular boxes of the original tensor, which any other layout reads back.

    Args:
        shape: the whole tensor's shape.
        dtype: its dtype.
        pieces: `(flat start, 1-D tensor of the slice's elements)` for each slice, in row-major order of the whole
            tensor.
    """

    shape: torch.Size
    dtype: torch.dtype
    pieces: list[tuple[int, torch.Tensor]]
    _views: dict[tuple[int, ...], torch.Tensor] | None = field(default=None, repr=False)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """(offsets, sizes, view of the slice holding that box) for every box the pieces cover."""
        out = []
        for start, data in self.pieces:
            for offsets, sizes in flat_range_boxes(tuple(self.shape), start, start + data.numel()):
                first = box_start(tuple(self.shape), offsets) - start
                out.append((offsets, sizes, data[first : first + math.prod(sizes)].view(sizes)))
        return out

    def view(self, offsets: tuple[int, ...]) -> torch.Tensor:
        """The view of the box that starts at `offsets` (one of those `boxes` gives).

        Args:
            offsets: the box's offsets in the whole tensor.
        """
        if self._views is None:
            self._views = {tuple(o): v for o, _, v in self.boxes()}
        return self._views[tuple(offsets)]
