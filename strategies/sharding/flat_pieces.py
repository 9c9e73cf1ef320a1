"""Flat slices of a tensor seen as rectangular chunks of the original tensor.

A rank holds contiguous slices of each flattened parameter (layout.py). A slice [start, end) of a row-major
tensor is a few rectangular boxes of it: a partial first row, a block of whole rows and a partial last row, and
so on down the dimensions (at most two per dimension and one block). Each box is contiguous in the flat order, so
it is a plain view of the slice. Checkpoints store tensors as such boxes (offsets and sizes in the original
tensor), which any other layout can read back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
