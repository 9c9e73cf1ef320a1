"""Whole tensors for an optimizer whose step reads them (step_kind.py), the model state staying sharded.

Each parameter of such an optimizer has an owner among the ranks that shard it: the largest first, each to the
rank that owns the fewest elements so far, so that every rank steps about 1/N of them (torch's
ZeroRedundancyOptimizer owns parameters whole the same way). A rank's optimizer holds a tensor of the parameter's
own shape for each parameter it owns (`Member.whole`) and keeps the state of those only. Around each step:

1. before it, every rank sends each owner its pieces of the gradients and of the master weights (one all-to-all)
   and the owner lays them out whole. A piece of a tensor split by tensor parallel is then put together with the
   other tensor-parallel ranks' pieces (they own the same parameters), so the step sees the unsplit matrix;
2. the optimizer steps the whole tensors;
3. after it, each owner sends every rank its piece of the new weights, into the master (one all-to-all), and
   the engine brings every copy up to date as after any step. The whole tensors are freed again (their storage
   resized to nothing, as an fsdp unit's): between steps a rank holds its pieces and the state of what it owns.

Without sharded optimizer state (ddp) every rank steps every parameter, which is whole already, except a piece of
a tensor split by tensor parallel: that is put together the same way, and its piece taken back after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .collectives import CommStats, all_to_all
from .groups import Groups
from .layout import Piece
from .parameter import metadata_access
from .unit import ShardUnit

EVERY_RANK = -1  # the owner of a parameter without sharded optimizer state


class SplitTensor(Protocol):
    """A parameter that is one rank's piece of a larger tensor split over other ranks (tensor parallel)."""

    shape: torch.Size  # of the whole tensor

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's `local` piece. Collective over the ranks that split it."""
        ...

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `whole`."""
        ...


@dataclass
class Member:
    """One parameter of the optimizer: where it lives, who steps it, and what that rank's optimizer steps."""

    unit: ShardUnit
    index: int
    owner: int  # rank in the shard group, or EVERY_RANK
    pieces: list[Piece | None]  # each shard rank's piece of it (sharded optimizer state)
    split: SplitTensor | None
    whole: nn.Parameter | None = None  # on the rank that steps it; the module's parameter when that is whole

    @property
    def param(self) -> nn.Parameter:
        return self.unit.params[self.index]

    @property
    def shape(self) -> torch.Size:
        return self.split.shape if self.split is not None else self.param.shape


class WholeTensorSteps:
    """Steps `optimizer` on whole tensors (see the module docstring); replaces its groups' parameters by the
    tensors this rank steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        unit_of: dict[int, tuple[ShardUnit, int]],
        groups: Groups,
        sharded: bool,
        splits: dict[int, SplitTensor],
        stats: CommStats,
    ) -> None:
        self.groups, self.sharded, self.stats = groups, sharded, stats
        self.rank = groups.rank
        self._by_group = [
            [self._member(*unit_of[id(p)], splits.get(id(p))) for p in group["params"]]
            for group in optimizer.param_groups
        ]
        self.members = [m for group in self._by_group for m in group]
        self._members_by_place = {(id(m.unit), m.index): m for m in self.members}
        self._assign_owners()
        self._stepping: list[Member] = []

    def replace_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Give `optimizer`'s groups the tensors this rank steps, in place of the module's parameters."""
        for group, members in zip(optimizer.param_groups, self._by_group):
            group["params"] = [m.whole for m in members if m.whole is not None]

    def _member(self, unit: ShardUnit, index: int, split: SplitTensor | None) -> Member:
        pieces = [next((p for p in ps if p.param_index == index), None) for ps in unit.pieces_by_rank]
        return Member(unit, index, EVERY_RANK, pieces, split)

    def _assign_owners(self) -> None:
        """Each parameter's owner (assign_owners), then the tensors this rank steps."""
        if self.sharded:
            for m, owner in zip(self.members, assign_owners([m.shape.numel() for m in self.members], self.groups.size)):
                m.owner = owner
        for m in self.members:
            if m.owner == self.rank or m.owner == EVERY_RANK:
                if m.split is None and not self.sharded:
                    m.whole = m.param  # replicated and whole: stepped as it is
                else:
                    m.whole = nn.Parameter(_freed(torch.empty(m.shape, dtype=m.unit.dtype, device=_home(m))))
                    m.whole.requires_grad_(m.unit.trainable[m.index])

    def owned(self) -> list[Member]:
        """The parameters this rank's optimizer steps."""
        return [m for m in self.members if m.whole is not None]

    # ---- around the step ----------------------------------------------------------------------------
    def before_step(self) -> None:
        """Lay out the whole gradients and weights of the parameters this rank steps."""
        with metadata_access():  # (placeholders: only whether a gradient is there is read)
            self._stepping = [m for m in self.members if m.unit.trainable[m.index] and m.param.grad is not None]
        stepped = [m for m in self._stepping if m.whole is not None and m.whole is not m.param]
        if self.sharded:
            laid_out = self._to_owners()
        else:  # ddp: the local pieces of tensors split by tensor parallel
            laid_out = {id(m): (m.param.detach(), _plain(m.param.grad)) for m in stepped}
        for m in stepped:
            value, grad = laid_out[id(m)]
            if m.split is not None:  # (the local piece's shape, which flat pieces were laid out in)
                value, grad = (m.split.gather(t.reshape(m.param.shape)) for t in (value, grad))
            m.whole.data = value.reshape(m.shape)
            m.whole.grad = grad.reshape(m.shape)

    def after_step(self) -> None:
        """Hand the new weights back to the ranks that hold them, and free the whole tensors."""
        stepped = [m for m in self._stepping if m.whole is not None and m.whole is not m.param]
        if self.sharded:
            self._from_owners()
        else:
            with torch.no_grad():
                for m in stepped:
                    m.param.copy_(m.split.piece(m.whole))
        for m in stepped:
            m.whole.grad = None
            _freed(m.whole.data)
        self._stepping = []

    def _to_owners(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's pieces of the gradients and master weights, sent to their owners and laid out flat there
        (gradient, weights) for each parameter this rank owns. One all-to-all per dtype."""
        out = {}
        for members in _by_dtype(self._stepping):
            sends: list[list[torch.Tensor]] = [[] for _ in range(self.groups.size)]
            for m in members:
                if m.pieces[self.rank] is not None:
                    shard = m.unit.shard_params[m.index]
                    sends[m.owner] += [shard.grad.reshape(-1), shard.detach()]
            mine = [m for m in members if m.owner == self.rank]
            sizes = [2 * sum(m.pieces[r].numel for m in mine if m.pieces[r] is not None) for r in range(len(sends))]
            received = self._exchange(sends, sizes, members[0])
            for m in mine:
                grad, value = (torch.empty(m.param.numel(), dtype=m.unit.dtype, device=_home(m)) for _ in range(2))
                out[id(m)] = (value, grad)
            for r, data in enumerate(received):
                offset = 0
                for m in (m for m in mine if m.pieces[r] is not None):
                    piece, value, grad = m.pieces[r], *out[id(m)]
                    grad[piece.start : piece.end].copy_(data[offset : offset + piece.numel])
                    value[piece.start : piece.end].copy_(data[offset + piece.numel : offset + 2 * piece.numel])
                    offset += 2 * piece.numel
        return out

    def _from_owners(self) -> None:
        """Each owner's new weights, sent in pieces to the ranks that hold them, into their master pieces."""
        for members in _by_dtype(self._stepping):
            sends: list[list[torch.Tensor]] = [[] for _ in range(self.groups.size)]
            for m in (m for m in members if m.owner == self.rank):
                local = (m.split.piece(m.whole) if m.split is not None else m.whole).detach().reshape(-1)
                for r, piece in enumerate(m.pieces):
                    if piece is not None:
                        sends[r].append(local[piece.start : piece.end])
            held = [m for m in members if m.pieces[self.rank] is not None]
            sizes = [sum(m.pieces[self.rank].numel for m in held if m.owner == r) for r in range(len(sends))]
            received = self._exchange(sends, sizes, members[0])
            with torch.no_grad():
                for r, data in enumerate(received):
                    offset = 0
                    for m in (m for m in held if m.owner == r):
                        n = m.pieces[self.rank].numel
                        m.unit.shard_params[m.index].copy_(data[offset : offset + n])
                        offset += n

    def _exchange(self, sends: list[list[torch.Tensor]], sizes: list[int], like: Member) -> list[torch.Tensor]:
        empty = torch.empty(0, dtype=like.unit.dtype, device=like.unit.device)
        flat = [torch.cat([t.to(like.unit.device) for t in ts]) if ts else empty for ts in sends]
        received = all_to_all(flat, sizes, self.groups.shard, self.stats, unit="<whole-tensor step>")
        return [t.to(_home(like)) for t in received]

    # ---- what checkpoints read ----------------------------------------------------------------------------
    def stepped_tensor(self, unit: ShardUnit, index: int) -> torch.Tensor | None:
        """The tensor this rank's optimizer keeps the state of parameter (unit, index) under, if it steps it."""
        m = self._find(unit, index)
        return None if m is None else m.whole

    def shape_of(self, unit: ShardUnit, index: int) -> torch.Size:
        """The whole shape of parameter (unit, index) (under tensor parallel, the unsplit tensor's)."""
        m = self._find(unit, index)
        return unit.layout.shapes[index] if m is None else m.shape

    def _find(self, unit: ShardUnit, index: int) -> Member | None:
        return self._members_by_place.get((id(unit), index))


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """The rank that steps each tensor of `sizes` elements whole: the largest first, each to the rank with the
    fewest elements so far, ties to the lowest rank (so every rank finds the same from the same sizes)."""
    loads, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owners[i]] += sizes[i]
    return owners


def _by_dtype(members: list[Member]) -> list[list[Member]]:
    dtypes: dict[torch.dtype, list[Member]] = {}
    for m in members:
        dtypes.setdefault(m.unit.dtype, []).append(m)
    return list(dtypes.values())


def _home(m: Member) -> torch.device:
    """Where the master weights (and so the step) live: CPU memory when offloaded."""
    return m.unit.shard_device


def _freed(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)
    return t


def _plain(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a plain tensor (tensor parallel's pieces are a subclass whose norms are collective)."""
    return grad.as_subclass(torch.Tensor) if type(grad) is not torch.Tensor else grad
