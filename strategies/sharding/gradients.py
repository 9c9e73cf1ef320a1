"""A unit's gradients: the two stores that keep and reduce them, what `.grad` holds when they are sharded, and
what a user does with them before the optimizer step.

The store, chosen once from the spec (`gradient_store`):
- ReplicatedGradients (ddp, zero1): one flat bucket in the unit's layout, each parameter's `.grad` a view of it,
  averaged by an all-reduce in place. zero1's optimizer reads this rank's slice of it.
- ShardedGradients (zero2, fsdp): each parameter's `.grad` is reduce-scattered as it is, and this rank keeps only
  its slice, summed over the micro-batches of a step; full-size gradients live only until their reduction.

Both send one "used" flag per parameter with the gradients (1 where this rank has a gradient for it), summed by
the same collective, so no extra message is needed to know which parameters some rank used. A parameter that no
rank used keeps `.grad is None` and is not stepped, as in one process; one used on some ranks only gets the
average over all ranks (zeros from the others), as with torch DDP.

What `.grad` of a parameter holds when gradients are sharded (zero2, fsdp): a placeholder of the parameter's
shape and dtype standing for the averaged gradient, of which this rank holds one slice (no memory of its own).

torch's gradient utilities work on it as on the full gradient, as they do on FSDP2's DTensor gradients:
- norms (`torch.linalg.vector_norm`, `Tensor.norm`, `torch._foreach_norm`: what `clip_grad_norm_` calls) are the
  full gradient's: each parameter's norm is combined from every rank's slice. The norms of all parameters are
  combined at once, in one all-reduce, and kept until a gradient changes, so `clip_grad_norm_(model.parameters())`
  costs one small collective. A norm is therefore collective: every rank must ask for it.
- scaling and clamping in place (`mul_`, `div_`, `clamp_`, `zero_` and their foreach forms: what `clip_grad_norm_`
  and `clip_grad_value_` call) apply to this rank's slice, so every slice is clipped.
Every other computation on it is an error that says what works (the class refuses as parameter.py's do).

What a user does with the gradients between backward and the optimizer step: read the tensors this rank's
optimizer steps from, clip them (by the global norm over every rank, or by value), and gather them in full for
inspection.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Work, all_reduce_sum, collective, reduce_scatter_parts, wait
from .parameter import ShardedParameterError, _Refuses, metadata_access

if TYPE_CHECKING:
    from .groups import Groups
    from .spec import ShardingSpec
    from .unit import ShardUnit


# ---- the stores --------------------------------------------------------------------------------------------
class NoGradients:
    """A unit without trainable parameters."""

    nbytes = 0
    split: dict[int, Any] = {}  # never written here (ShardingEngine.split_elsewhere)

    def on_grad_ready(self, index: int) -> None: ...
    def launch(self) -> None: ...
    def advance(self) -> None: ...
    def finish(self) -> None: ...
    def attach(self) -> None: ...
    def zero(self, indices: list[int], set_to_none: bool = True) -> None: ...

    def tensors(self, indices: list[int] | None = None) -> list[torch.Tensor]:
        return []

    def refresh(self) -> None: ...
    def hide(self) -> None: ...

    def pending_flags(self) -> torch.Tensor | None:
        return None


class ReplicatedGradients:
    split: dict[int, Any] = {}  # parameter index -> group (ShardingEngine.split_elsewhere)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit
        layout, n = unit.layout, len(unit.params)
        self.buffer = torch.zeros(layout.padded_total + n, dtype=unit.reduce_dtype, device=unit.device)
        self.flat, self.flags = self.buffer[: layout.padded_total], self.buffer[layout.padded_total :]
        self.views = layout.views(self.flat)
        self.zeroed = [True] * n  # regions known to hold zeros
        self.used: list[bool] | None = None  # by the last reduction; None while nothing is reduced
        self._used_pending: torch.Tensor | None = None  # the last reduction's flags, not yet read by the host
        self._all_used_here = False  # this rank had a gradient for every trainable parameter (known_flags)
        self._known_flags = known_flags(unit)  # made once: read, never written
        self._work: Work = None
        self._launched = False
        sharded = unit.spec.shard_optimizer_state
        self._own_range = layout.shard_range(unit.rank) if sharded else (0, layout.padded_total)
        self.own = self._own_view()  # what this rank's optimizer steps from, in the master's dtype

    def _own_view(self) -> torch.Tensor:
        lo, hi = self._own_range
        master_dtype = self.unit.dtype
        self._own_version = self.flat._version
        return self.flat[lo:hi] if self.flat.dtype == master_dtype else self.flat[lo:hi].to(master_dtype)

    @property
    def nbytes(self) -> int:
        """The bucket, and under mixed precision the slice the optimizer reads, in the master's dtype."""
        copy = self.own.numel() * self.own.element_size() if self.flat.dtype != self.unit.dtype else 0
        return self.flat.numel() * self.flat.element_size() + copy

    def on_grad_ready(self, index: int) -> None:
        """Move autograd's fresh tensor into the bucket (accumulation into the view itself happens in place)."""
        p, view = self.unit.params[index], self.views[index]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self.zeroed[index] = False

    def launch(self) -> None:
        has_grad = []
        for index, p in enumerate(self.unit.params):
            has_grad.append(p.grad is not None)
            if p.grad is None and not self.zeroed[index]:  # last step's values: this step has none here
                self.views[index].zero_()
                self.zeroed[index] = True
        fill_flags(self.flags, has_grad)
        self._all_used_here = has_grad == self.unit.trainable
        self._work = all_reduce_sum(
            self.buffer, self.unit.groups.everyone, self.unit.stats, async_op=True, unit=self.unit.name
        )
        self._launched = True

    def finish(self) -> None:
        if not self._launched:
            return
        with self.unit.naming_failures("gradient reduction"):
            wait(self._work)
        self._work, self._launched = None, False
        if self.unit.groups.data_parallel_size > 1:
            self.buffer.div_(self.unit.groups.data_parallel_size)
        # Read with every unit's at the end of backward (read_used_flags), unless this rank's own flags settle it.
        self._used_pending = self._known_flags if self._all_used_here else self.flags > 0
        self.own = self._own_view()  # (a copy in the master's dtype under mixed precision)

    def pending_flags(self) -> torch.Tensor | None:
        return self._used_pending

    def take_flags(self, used: torch.Tensor) -> None:
        self.used = used.tolist()
        self.zeroed = [not u for u in self.used]  # every region now holds the average of all ranks
        self._used_pending = None

    def advance(self) -> None: ...  # an all-reduce frees nothing before it is done

    def attach(self) -> None:
        """After a reduction: `.grad` is the averaged gradient where some rank used the parameter, else None."""
        read_used_flags([self])
        if self.used is None:
            return
        for index, (p, used) in enumerate(zip(self.unit.params, self.used)):
            if self.unit.trainable[index]:
                view = self.views[index]
                if used and index in self.split:  # a piece of a tensor split over other ranks too
                    view = split_gradient(view, self.split[index])
                p.grad = view if used else None
        for piece in self.unit.pieces:  # zero1: the optimizer's slices
            shard = self.unit.shard_params[piece.param_index]
            if shard.requires_grad:
                used = self.used[piece.param_index]
                shard.grad = self.own[piece.shard_offset : piece.shard_offset + piece.numel] if used else None
        self.used = None

    def zero(self, indices: list[int], set_to_none: bool = True) -> None:
        """As torch's zero_grad: `.grad` becomes None (or zeros), here and on the optimizer's slices."""
        for index in indices:
            p = self.unit.params[index]
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for piece in self.unit.pieces:
            if piece.param_index in indices:
                shard = self.unit.shard_params[piece.param_index]
                shard.grad = None if set_to_none or shard.grad is None else shard.grad.zero_()

    def tensors(self, indices: list[int] | None = None) -> list[torch.Tensor]:
        """What this rank's optimizer steps from (all of it, or the parts of the parameters `indices`)."""
        self.refresh()
        if indices is None:
            return [self.own]
        if self.unit.spec.shard_optimizer_state:
            return _piece_parts(self.own, self.unit.pieces, indices)
        return [self.views[i] for i in indices]

    def refresh(self) -> None:
        """Under mixed precision the optimizer steps from a copy of this rank's slice in the master's dtype: when
        `.grad` (a view of the bucket) was changed in place since, by torch's clip_grad_norm_ on the model's
        parameters say, copy it again."""
        if self.flat.dtype != self.unit.dtype and self.flat._version != self._own_version:
            lo, hi = self._own_range
            self.own.copy_(self.flat[lo:hi])
            self._own_version = self.flat._version


class ShardedGradients:
    split: dict[int, Any] = {}  # parameter index -> group (ShardingEngine.split_elsewhere)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit
        self.shard: torch.Tensor | None = None  # this rank's slice, made by the first reduction after zero
        self.used = [False] * len(unit.params)  # since zero, by any rank (a list: read and set for every unit)
        # Reduced but not yet folded in: "used" flags still on the device (read at the end of backward, one wait
        # for all units instead of one per unit), and offloaded outputs on their way to pinned host memory.
        self._used_on_device: list[torch.Tensor] = []
        self._arriving: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._work: Work = None
        self._output: torch.Tensor | None = None
        self._across_groups = False  # hybrid: the reduce-scatter is done, the all-reduce across groups in flight
        self._placeholders: dict[int, ShardedGradient] = {}  # by parameter index: made once, shown at every step
        self._shown = False  # some parameter's `.grad` is a placeholder now
        self.norms: GradientNorms | None = None  # the engine's, shared by all its units (see GradientNorms)
        self._generation = 0  # counts the shards this store has made: with the version, whether it changed
        self.size = unit.layout.trainable_shard_size  # the gradient shard covers the trainable segment only
        self.output_size = self.size + len(unit.params)  # this rank's slice of a reduction: the shard, then flags
        self.pieces = [p for p in unit.pieces if unit.trainable[p.param_index]]
        self._plan = [self._rank_plan(pieces) for pieces in unit.pieces_by_rank]
        self._padding: dict[int, torch.Tensor] = {}  # zeros sent for padding, by length: made once, only read
        # The used flags sent with the gradients: rewritten only when they change (sent by reference, so only once
        # this unit's previous reduction is done, which every backward waits for).
        self._flags = torch.ones(len(unit.params), dtype=unit.reduce_dtype, device=unit.device)
        self._flags_values = [True] * len(unit.params)
        self._all_used_here = False  # in the reduction being formed: this rank used every trainable parameter
        self._all_used_pending = False  # some reduction not yet read was one of those (known_flags)
        self._known_flags = known_flags(unit)  # made once: read, never written
        # Fixed for the unit's life, so worked out once (these run for every unit at every step).
        self._scale = 1.0 / unit.groups.data_parallel_size
        self._offloaded = unit.shard_device != unit.device
        self._cast_back = unit.reduce_dtype != unit.master.dtype
        self._split_sizes, self._split_index = self._piece_split()

    def _rank_plan(self, pieces: list) -> list[tuple[int, int, int] | int]:
        """What makes up one rank's slice, worked out once from the layout: (parameter index, start, end) for a
        piece of a gradient, a length for zeros (padding at the end of a chunk)."""
        plan: list[tuple[int, int, int] | int] = []
        filled = 0
        for piece in (p for p in pieces if self.unit.trainable[p.param_index]):
            if piece.shard_offset > filled:
                plan.append(piece.shard_offset - filled)
            whole = piece.start == 0 and piece.end == self.unit.layout.numels[piece.param_index]
            plan.append((piece.param_index, piece.start, piece.end) if not whole else (piece.param_index, 0, -1))
            filled = piece.shard_offset + piece.numel
        if filled < self.size:
            plan.append(self.size - filled)
        return plan

    def _piece_split(self) -> tuple[list[int], list[int] | None]:
        """Sizes that split the gradient shard into its pieces (and the gaps between them), and where each piece
        is among them: `attach` makes every piece's view with one call. None when the pieces are out of order."""
        sizes: list[int] = []
        index: list[int] = []
        filled = 0
        for piece in self.pieces:
            if piece.shard_offset < filled:
                return [], None
            if piece.shard_offset > filled:
                sizes.append(piece.shard_offset - filled)
            index.append(len(sizes))
            sizes.append(piece.numel)
            filled = piece.shard_offset + piece.numel
        if filled < self.size:
            sizes.append(self.size - filled)
        return sizes, index

    @property
    def nbytes(self) -> int:
        return self.size * self.unit.master.element_size()

    def on_grad_ready(self, index: int) -> None: ...  # gradients wait in `.grad` for their reduction

    def _parts(self, grads: list[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """Rank r's slice of the unit's padded flat gradient plus the used flags, as tensors that concatenate
        to it: pieces of the parameters' `.grad` (`grads`, in the reduce dtype), zeros where a parameter has none."""
        unit = self.unit
        dtype, device = unit.reduce_dtype, unit.device
        values = [g is not None for g in grads]
        if values != self._flags_values:
            fill_flags(self._flags, values)
            self._flags_values = values
        self._all_used_here = values == unit.trainable
        flags = self._flags
        flat = [None if g is None else _flat(g) if g.dtype == dtype else _flat(g).to(dtype) for g in grads]
        parts = []
        for plan in self._plan:
            rank_parts = []
            for entry in plan:
                if type(entry) is int:  # padding
                    rank_parts.append(self._zeros(entry))
                elif (grad := flat[entry[0]]) is None:
                    rank_parts.append(
                        torch.zeros(
                            unit.layout.numels[entry[0]] if entry[2] < 0 else entry[2] - entry[1],
                            dtype=dtype,
                            device=device,
                        )
                    )
                else:
                    rank_parts.append(grad if entry[2] < 0 else grad[entry[1] : entry[2]])
            rank_parts.append(flags)
            parts.append(rank_parts)
        return parts

    def _zeros(self, length: int) -> torch.Tensor:
        zeros = self._padding.get(length)
        if zeros is None:
            zeros = self._padding[length] = torch.zeros(length, dtype=self.unit.reduce_dtype, device=self.unit.device)
        return zeros

    def launch(self) -> None:
        launch_together([self])

    def _prepare(self) -> list[list[torch.Tensor]]:
        """The parts of every rank's slice (`_parts`), once placeholders of an earlier micro-batch are dropped."""
        with metadata_access():  # (read here: the parameters are usually placeholders again by now)
            grads = [p.grad for p in self.unit.params]
            for p, grad in zip(self.unit.params, grads):
                if type(grad) is ShardedGradient:  # a placeholder of an earlier micro-batch is no gradient to send
                    p.grad = None
        return self._parts([None if type(g) is ShardedGradient else g for g in grads])

    def advance(self) -> None:
        """Free what backward no longer needs: the `.grad` tensors, once the reduce-scatter has sent them. Under
        hybrid sharding the all-reduce across the groups is then started, and waited for by `finish`."""
        if self._output is None or self._across_groups:
            return
        if not self.unit.groups.hybrid:
            self.finish()  # nothing more to send: add it to the shard now, freeing the output
        else:
            self._start_across_groups()

    def _wait_reduce_scatter(self) -> None:
        if self._work is not None:  # (None: done already, as on one rank)
            with self.unit.naming_failures("gradient reduction"):
                wait(self._work)
        with metadata_access():  # (the parameters are usually sharded again: placeholders)
            for p in self.unit.params:
                p.grad = None
        self._work = None

    def _start_across_groups(self) -> None:
        self._wait_reduce_scatter()
        unit = self.unit
        self._work = all_reduce_sum(self._output, unit.groups.replicate, unit.stats, async_op=True, unit=unit.name)
        self._across_groups = True

    def finish(self) -> None:
        if self._output is None:
            return
        unit = self.unit
        if unit.groups.hybrid and not self._across_groups:
            self._start_across_groups()
        if self._across_groups:
            with unit.naming_failures("gradient reduction across groups"):
                wait(self._work)
        else:
            self._wait_reduce_scatter()
        reduced = self._output.to(unit.master.dtype) if self._cast_back else self._output
        if self._offloaded:  # cpu_offload: copied to pinned memory while the GPU goes on
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            self._arriving.append((host, arrived))
        else:
            self._add(reduced)
        self._work = self._output = None
        self._across_groups = False

    def _add(self, reduced: torch.Tensor) -> None:
        """Fold one averaged reduction (this rank's slice, then the used flags) into the gradient shard."""
        size, scale = self.size, self._scale
        self._used_on_device.append(reduced[size:])  # (compared with 0 for every unit at once: read_used_flags)
        self._all_used_pending |= self._all_used_here
        if self.shard is None:  # the first reduction since zero: the averaged output becomes the gradient
            self.shard = reduced[:size].mul_(scale) if scale != 1.0 else reduced[:size]
            self._generation += 1
        else:
            self.shard.add_(reduced[:size], alpha=scale)

    def _settle(self) -> None:
        """Wait for what is still arriving and read the used flags (called before either is looked at)."""
        if self._used_on_device or self._arriving:
            read_used_flags([self])

    def pending_flags(self) -> torch.Tensor | None:
        """The used flags of the reductions not yet read, as counts of the ranks that used each parameter
        (summed over the reductions; offloaded ones once they have arrived): used where above 0."""
        for host, arrived in self._arriving:
            arrived.synchronize()
            self._add(host)
        self._arriving.clear()
        if not self._used_on_device:
            return None
        if self._all_used_pending:
            return self._known_flags
        flags = self._used_on_device[0]
        for more in self._used_on_device[1:]:
            flags = flags + more
        return flags

    def take_flags(self, used: torch.Tensor) -> None:
        self.used = [before or now for before, now in zip(self.used, used.tolist())]
        self._used_on_device.clear()
        self._all_used_pending = False

    def attach(self) -> None:
        """Point each trainable shard parameter's `.grad` at its slice, and give each parameter of the model a
        placeholder `.grad` standing for its gradient (None where no rank had a gradient), as in one process."""
        self._settle()
        used = self.used
        views = self.shard.split_with_sizes(self._split_sizes) if self.shard is not None and self._split_index else None
        for i, piece in enumerate(self.pieces):
            shard = self.unit.shard_params[piece.param_index]
            if shard.requires_grad:
                if self.shard is None or not used[piece.param_index]:
                    shard.grad = None
                elif views is not None:
                    shard.grad = views[self._split_index[i]]
                else:
                    shard.grad = self.shard[piece.shard_offset : piece.shard_offset + piece.numel]
        self._show(used)

    def zero(self, indices: list[int], set_to_none: bool = True) -> None:
        self._settle()
        if set_to_none and len(indices) == len(self.unit.params):  # the usual case: every gradient goes
            self.used = [False] * len(self.used)
            if self.shard is not None:
                self.shard = None
                self._generation += 1
            with metadata_access():
                for piece in self.pieces:
                    self.unit.shard_params[piece.param_index].grad = None
                for p, trainable in zip(self.unit.params, self.unit.trainable):
                    if trainable:
                        p.grad = None
            self._shown = False
            return
        if set_to_none:
            for index in indices:
                self.used[index] = False
        if self.shard is not None:
            if not set_to_none or any(self.used):
                for piece in self.pieces:
                    if piece.param_index in indices:
                        self.shard[piece.shard_offset : piece.shard_offset + piece.numel].zero_()
            else:
                self.shard = None  # as torch's zero_grad(set_to_none=True): no memory held between steps
                self._generation += 1
        self.attach()

    def tensors(self, indices: list[int] | None = None) -> list[torch.Tensor]:
        self._settle()
        if self.shard is None:
            return []
        return [self.shard] if indices is None else _piece_parts(self.shard, self.pieces, indices)

    def _show(self, used: list[bool]) -> None:
        """`.grad` of each trainable parameter: a placeholder (ShardedGradient) where some rank had a gradient since
        zero_grad, else None."""
        unit = self.unit
        for index, p in enumerate(unit.params):
            if used[index] and unit.trainable[index] and index not in self._placeholders:
                self._placeholders[index] = sharded_gradient(p, unit.param_names[index], self, index)
        with metadata_access():
            for index, p in enumerate(unit.params):
                if unit.trainable[index]:
                    p.grad = self._placeholders[index] if used[index] else None
        self._shown = any(used)

    def hide(self) -> None:
        """Drop the placeholders from `.grad` before autograd accumulates new gradients there: a placeholder is no
        gradient to add to (the earlier micro-batches' are in the shard already), so autograd must find None. (A
        unit whose every gradient is hooked drops each one in its hook instead: `_drop_placeholder`.)"""
        if self._shown:
            with metadata_access():
                for p, trainable in zip(self.unit.params, self.unit.trainable):
                    if trainable and type(p.grad) is ShardedGradient:
                        p.grad = None
            self._shown = False

    def part(self, index: int) -> torch.Tensor:
        """This rank's slice of parameter `index`'s averaged gradient (empty when it holds none of it)."""
        self._settle()
        parts = _piece_parts(self.shard, self.pieces, [index]) if self.shard is not None else []
        return parts[0] if parts else self.unit.master.new_empty(0)

    def visible_indices(self) -> list[int]:
        """The parameters whose `.grad` is a placeholder (the same on every rank)."""
        self._settle()
        return [
            i
            for i, (used, trainable) in enumerate(zip(self.used, self.unit.trainable))
            if used and trainable and self.shard is not None
        ]

    def state_token(self) -> tuple[int, int]:
        """Changes whenever the gradient shard does (a new shard, or a write into it)."""
        self._settle()
        return self._generation, self.shard._version if self.shard is not None else -1

    def refresh(self) -> None: ...


def gradient_store(unit: ShardUnit) -> NoGradients | ReplicatedGradients | ShardedGradients:
    """The store of `unit`'s gradients, chosen once from the spec (the engine gives this to every unit it builds)."""
    stores = {False: ReplicatedGradients, True: ShardedGradients}
    return stores[unit.spec.shard_gradients](unit) if any(unit.trainable) else NoGradients()


def launch_together(stores: list[ShardedGradients]) -> None:
    """Start the reduce-scatter of several units' gradients as one collective (units of one reduce dtype, device
    and group): rank r's slice is every unit's slice for r, end to end, so each unit's output is a piece of the
    one output and every element is summed as it would be alone. Small units so pay one collective's latency."""
    unit = stores[0].unit
    sizes = [store.output_size for store in stores]
    prepared = [store._prepare() for store in stores]
    parts = [[t for rank_parts in prepared for t in rank_parts[r]] for r in range(unit.world_size)]
    output = torch.empty(sum(sizes), dtype=unit.reduce_dtype, device=unit.device)
    name = unit.name if len(stores) == 1 else "+".join(store.unit.name or "<root>" for store in stores)
    work = reduce_scatter_parts(output, parts, unit.groups.shard, unit.stats, async_op=True, unit=name)
    for store, piece in zip(stores, output.split_with_sizes(sizes)):  # (not the Python wrapper torch.split)
        store._output, store._work = piece, work


def known_flags(unit: ShardUnit) -> torch.Tensor:
    """The used flags of a reduction in which this rank had a gradient for every trainable parameter: then
    every rank's sum is above 0 there, and no rank has one for a frozen parameter. A host tensor: reading it
    costs no wait for the GPU (the usual step, where every parameter is used, never waits)."""
    return torch.tensor(unit.trainable, dtype=torch.bool)


def read_used_flags(stores: list) -> None:
    """Bring the pending "used" flags of `stores` to the host with one copy: each copy from the GPU waits for
    everything queued before it, so one per unit would stall the host many times per backward. Flags already
    on the host (known_flags) are taken as they are."""
    pending = []
    for store in stores:
        flags = store.pending_flags()
        if flags is None:
            continue
        if flags.dtype == torch.bool and flags.device.type == "cpu":
            store.take_flags(flags)
        else:
            pending.append((store, flags))
    if not pending:
        return
    # (a store's flags are booleans or counts of ranks: used where above 0, compared once for every store)
    on_host = (torch.cat([flags.reshape(-1) for _, flags in pending]) > 0).cpu()
    for (store, _), host in zip(pending, torch.split(on_host, [f.numel() for _, f in pending])):
        store.take_flags(host)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened (without a call when it is 1-D already: this runs for every parameter at every step)."""
    return t if t.dim() == 1 else t.reshape(-1)


def fill_flags(flags: torch.Tensor, values: list[bool]) -> torch.Tensor:
    """Write 1/0 flags into a device tensor without a host-to-device copy (which would wait for the GPU)."""
    if all(values):
        return flags.fill_(1)
    flags.zero_()
    for index, value in enumerate(values):
        if value:
            flags[index] = 1
    return flags


def _piece_parts(shard: torch.Tensor, pieces: list, indices: list[int]) -> list[torch.Tensor]:
    """The parts of this rank's `shard` holding the pieces of the parameters `indices`."""
    wanted = set(indices)
    return [shard[p.shard_offset : p.shard_offset + p.numel] for p in pieces if p.param_index in wanted]


# ---- what `.grad` holds when gradients are sharded ---------------------------------------------------------
class ShardedGradient(_Refuses, torch.Tensor):
    """The placeholder `.grad` of a parameter whose gradient is sharded (see the module docstring)."""

    _sharded_name: str
    _sharded_world_size: int
    _store: weakref.ref  # the unit's ShardedGradients
    _index: int  # of the parameter in its unit

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    def refusal(self, operation: str) -> str:
        return (
            f"the gradient of {self._sharded_name!r} is reduce-scattered: each of the {self._sharded_world_size} "
            f"rank(s) holds only its shard, so it cannot be read here ({operation}). What works on it: "
            "torch.nn.utils.clip_grad_norm_ and clip_grad_value_, norms (.norm(), torch.linalg.vector_norm; "
            "collective: on every rank) and in-place scaling (mul_, div_, clamp_, zero_). Clip with "
            "strategy.clip_gradients(max_norm) or torch's functions; read it in full with "
            "strategy.full_gradients() (every rank), or use ddp / zero1, whose .grad is the full averaged "
            "gradient."
        )

    def part(self) -> torch.Tensor:
        """This rank's slice of the gradient (1-D, maybe empty), a view into the unit's gradient shard."""
        return self._store().part(self._index)

    def __repr__(self) -> str:
        return f"ShardedGradient({self._sharded_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def sharded_gradient(param: nn.Parameter, name: str, store: ShardedGradients, index: int) -> ShardedGradient:
    """A ShardedGradient for parameter `index` of `store`'s unit (no memory: one element seen at every position)."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    grad = torch.Tensor._make_subclass(ShardedGradient, zero)
    grad._sharded_name, grad._sharded_world_size = name, store.unit.world_size
    grad._store, grad._index = weakref.ref(store), index
    return grad


class GradientNorms:
    """The norm of every sharded gradient of an engine, combined over the ranks that shard it, computed for all of
    them at once and kept until one of the gradient shards changes."""

    def __init__(self, stores: list[ShardedGradients], groups: Groups, device: torch.device) -> None:
        self.stores, self.groups, self.device = stores, groups, device
        self._key: tuple | None = None
        self._norms: dict[tuple[int, int], torch.Tensor] = {}

    def norm(self, grad: ShardedGradient, ord: float) -> torch.Tensor:
        key = (ord, tuple(store.state_token() for store in self.stores))
        if key != self._key:
            self._norms, self._key = self._compute(ord), key
        return self._norms[id(grad._store()), grad._index]

    def _compute(self, ord: float) -> dict[tuple[int, int], torch.Tensor]:
        """Each rank's contribution for every parameter with a gradient, in a fixed order (the same on every
        rank: which parameters have one is agreed in backward), combined in one all-reduce."""
        entries = [(store, index) for store in self.stores for index in store.visible_indices()]
        if not entries:
            return {}
        parts = [store.part(index) for store, index in entries]
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts), torch.float32)
        local = torch.stack([_local_contribution(p.to(self.device, dtype), ord) for p in parts])
        if self.groups.size > 1:  # hybrid sharding: the copies of a shard are equal, so the shard group suffices
            dist.all_reduce(local, op=_REDUCE_OP.get(ord, dist.ReduceOp.SUM), group=self.groups.shard)
        local = _over_split_ranks(local, [store.split.get(index) for store, index in entries], ord)
        norms = _finish(local, ord)
        return {(id(store), index): norm for (store, index), norm in zip(entries, norms)}


_REDUCE_OP = {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}


def _over_split_ranks(contributions: torch.Tensor, groups: list[Any], ord: float) -> torch.Tensor:
    """The contributions of gradients that are pieces of tensors split over other ranks too (tensor parallel),
    combined over those ranks: one all-reduce per group, the others untouched."""
    if all(g is None for g in groups):
        return contributions
    contributions = contributions.clone()
    for group in {id(g): g for g in groups if g is not None}.values():
        chosen = [i for i, g in enumerate(groups) if g is group]
        combined = contributions[chosen]
        dist.all_reduce(combined, op=_REDUCE_OP.get(ord, dist.ReduceOp.SUM), group=group)
        contributions[chosen] = combined
    return contributions


def _local_contribution(part: torch.Tensor, ord: float) -> torch.Tensor:
    """What this rank's slice adds to a p-norm: the sum of |x|^p (the count of non-zeros for p=0), or for the
    infinity norms its max (min) of |x|; an empty slice adds nothing."""
    if part.numel() == 0:
        return torch.tensor(math.inf if ord == -math.inf else 0.0, dtype=part.dtype, device=part.device)
    norm = torch.linalg.vector_norm(part, ord)
    return norm if ord in (0, math.inf, -math.inf) else norm.pow(ord)


def _finish(combined: torch.Tensor, ord: float) -> torch.Tensor:
    return combined if ord in (0, math.inf, -math.inf) else combined.pow(1.0 / ord)


# ---- `.grad` of a piece of a tensor split over other ranks too (tensor parallel) ------------------------------
class SplitGradient(torch.Tensor):
    """The `.grad` of a parameter that is one piece of a larger tensor whose other pieces are on the ranks of
    another group (tensor parallel), where the whole gradient is replicated over the data-parallel ranks (ddp,
    zero1). It is the gradient itself; only torch's norms of it (`clip_grad_norm_`, `.norm()`) combine over the
    ranks of that group, so that every rank computes the norm of the whole tensor. Collective there."""

    _split_group: Any

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handler = _SPLIT_NORMS.get(func)
        with torch._C.DisableTorchFunctionSubclass():
            if handler is not None:
                return handler(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))


def split_gradient(view: torch.Tensor, group: Any) -> SplitGradient:
    grad = view.as_subclass(SplitGradient)
    grad._split_group = group
    return grad


def _split_norms(grads: list[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each gradient's norm, those of split gradients combined over their group (one all-reduce per group)."""
    norms = [torch.linalg.vector_norm(g, ord, dtype=dtype) for g in grads]
    groups = [getattr(g, "_split_group", None) for g in grads]
    if not any(g is not None for g in groups):
        return norms
    powered = torch.stack([n if ord in (0, math.inf, -math.inf) else n.pow(ord) for n in norms])
    return list(_finish(_over_split_ranks(powered, groups, ord), ord).to(norms[0].dtype).unbind())


def _split_vector_norm(
    grad: torch.Tensor, ord: float = 2, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if dim is not None:
        raise ValueError("the norm of a tensor-parallel gradient piece is taken whole (dim=None)")
    norm = _split_norms([grad], ord, dtype)[0]
    return norm.reshape([1] * grad.dim()) if keepdim else norm


def _split_tensor_norm(
    grad: torch.Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return _split_vector_norm(grad, 2 if p in (None, "fro") else p, dim, keepdim, dtype=dtype)


_SPLIT_NORMS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _split_vector_norm,
    torch.Tensor.norm: _split_tensor_norm,
    torch.norm: _split_tensor_norm,
    torch._foreach_norm: _split_norms,
}


# ---- what torch's functions may do with a ShardedGradient ------------------------------------------------
def _vector_norm(
    grad: torch.Tensor, ord: float = 2, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if not isinstance(grad, ShardedGradient):  # a plain tensor beside placeholders in a foreach list
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(grad, ord, dim, keepdim, dtype=dtype)
    if dim is not None:
        raise _refused(grad, f"vector_norm over dim={dim}")
    store = grad._store()
    norm = store.norms.norm(grad, float(ord))
    norm = norm.to(grad.device, dtype or grad.dtype)
    return norm.reshape([1] * grad.dim()) if keepdim else norm


def _tensor_norm(
    grad: torch.Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if p is None or p == "fro":
        p = 2
    if isinstance(p, str):
        raise _refused(grad, f"norm(p={p!r})")
    return _vector_norm(grad, p, dim, keepdim, dtype=dtype)


def _foreach_norm(grads: list[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [_vector_norm(g, ord, dtype=dtype) for g in grads]


def _in_place(operation: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """`operation(slice, *args)` on this rank's slice of the gradient; the placeholder itself is returned, as
    torch's in-place methods return their tensor."""

    def apply(grad: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = grad.part() if isinstance(grad, ShardedGradient) else grad
        with torch._C.DisableTorchFunctionSubclass():
            operation(target, *[_like(a, target) for a in args], **{k: _like(v, target) for k, v in kwargs.items()})
        return grad

    return apply


def _like(value: Any, target: torch.Tensor) -> Any:
    """A tensor operand (a clip coefficient) on the slice's device and in its dtype; scalars as they are."""
    if isinstance(value, ShardedGradient):
        raise _refused(value, "an operand of an in-place operation")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                "a sharded gradient can be scaled in place by a number or a one-element tensor only, "
                f"got a tensor of shape {tuple(value.shape)}"
            )
        return value.to(target.device, target.dtype)
    return value


def _foreach(single: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """torch._foreach_<op>_(tensors, operand): the single-tensor form on each (one operand for all, or a list)."""

    def apply(grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        if args and isinstance(args[0], (list, tuple)):
            for grad, operand in zip(grads, args[0]):
                single(grad, operand, *args[1:], **kwargs)
        else:
            for grad in grads:
                single(grad, *args, **kwargs)

    return apply


def _refused(grad: torch.Tensor, operation: str) -> Exception:
    return ShardedParameterError(grad.refusal(operation))


def _itself(grad: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return grad


_MUL, _DIV = _in_place(torch.Tensor.mul_), _in_place(torch.Tensor.div_)
_CLAMP, _ZERO = _in_place(torch.Tensor.clamp_), _in_place(torch.Tensor.zero_)
_CLAMP_MIN, _CLAMP_MAX = _in_place(torch.Tensor.clamp_min_), _in_place(torch.Tensor.clamp_max_)
_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _vector_norm,
    torch.Tensor.norm: _tensor_norm,
    torch.norm: _tensor_norm,
    torch._foreach_norm: _foreach_norm,
    torch.Tensor.mul_: _MUL,
    torch.Tensor.div_: _DIV,
    torch.Tensor.clamp_: _CLAMP,
    torch.Tensor.clamp_min_: _CLAMP_MIN,
    torch.Tensor.clamp_max_: _CLAMP_MAX,
    torch.Tensor.zero_: _ZERO,
    torch._foreach_mul_: _foreach(_MUL),
    torch._foreach_div_: _foreach(_DIV),
    torch._foreach_clamp_min_: _foreach(_CLAMP_MIN),
    torch._foreach_clamp_max_: _foreach(_CLAMP_MAX),
    torch._foreach_zero_: _foreach(_ZERO),
    # a detached alias of a gradient is the gradient: `p.grad.data.norm()`, `p.grad.detach_()` (Module.zero_grad)
    torch.Tensor.data.__get__: _itself,
    torch.Tensor.detach: _itself,
    torch.Tensor.detach_: _itself,
    torch.Tensor.grad_fn.__get__: lambda grad: None,
}


# ---- what a user does with the gradients between backward and the optimizer step ---------------------------
class _Engine(Protocol):
    """What the functions below read of the engine (engine.py's ShardingEngine, which imports this module)."""

    units: list[ShardUnit]
    spec: ShardingSpec
    groups: Groups
    world_size: int
    device: torch.device


def gradient_tensors(engine: _Engine, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The gradient tensors this rank's optimizer reads (of `params`, or all), in the master's dtype."""
    wanted = None if params is None else {id(p) for p in params}
    out = []
    for unit in engine.units:
        indices = None if wanted is None else [i for i, p in enumerate(unit.params) if id(p) in wanted]
        if indices != []:
            out += unit.grads.tensors(indices)
    return out


def clip_grad_norm_(
    engine: _Engine, max_norm: float, params: list[torch.Tensor] | None = None, also_over: Any = None
) -> torch.Tensor:
    """Scale gradients (of `params`, or all) so that their global L2 norm over every rank is <= max_norm. The
    norm is computed in the gradients' own dtype (the widest, if they differ), as torch's clip_grad_norm_.
    Pieces of tensors split over other ranks too (ShardingEngine.split_elsewhere) add their squares over those
    ranks; what every such rank holds alike counts once. `also_over`: a process group whose ranks hold other
    parameters of the model (a pipeline's stages), whose squares are added too."""
    split = {id(unit.params[i]): group for unit in engine.units for i, group in unit.grads.split.items()}
    if not split:
        parts = [(gradient_tensors(engine, params), None)]
    else:
        chosen = [p for unit in engine.units for p in unit.params] if params is None else params
        groups = {id(g): g for g in split.values()}
        parts = [(gradient_tensors(engine, [p for p in chosen if id(p) not in split]), None)]
        parts += [
            (gradient_tensors(engine, [p for p in chosen if split.get(id(p)) is group]), group)
            for group in groups.values()
        ]
    total = None
    for grads, group in parts:
        part = _sum_of_squares(engine, grads)
        if group is not None:
            dist.all_reduce(part, group=group)
        total = part if total is None else total + part.to(total.dtype)
    if also_over is not None:
        dist.all_reduce(total, group=also_over)
    total = total.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads, _ in parts:
        for grad in grads:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def _sum_of_squares(engine: _Engine, grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of `grads` over the ranks that shard them."""
    squares = [torch.linalg.vector_norm(g).square() for g in grads]
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in squares), torch.float32)
    total = torch.zeros((), dtype=dtype, device=engine.device)
    for square in squares:
        total += square.to(engine.device, dtype)
    if engine.spec.shard_optimizer_state and engine.world_size > 1:
        with collective("all_reduce", "<gradient norm>", 1, engine.groups.shard):
            dist.all_reduce(total, group=engine.groups.shard)
    return total


def clip_grad_value_(engine: _Engine, value: float, params: list[torch.Tensor] | None = None) -> None:
    """Clamp every gradient element (of `params`, or all) to [-value, value]; element-wise, so each rank
    clamps what it holds."""
    for grad in gradient_tensors(engine, params):
        grad.clamp_(-value, value)


def full_gradients(engine: _Engine) -> dict[str, torch.Tensor]:
    """Every parameter's averaged gradient in full, by name (those without one left out). Collective; holds
    them all at once: for inspection, not for every step."""
    out = {}
    for unit in (u for u in engine.units if any(u.trainable)):
        if engine.spec.shard_gradients:
            shard = unit.grads.tensors()
            if not shard:  # no gradient since zero_grad (on every rank alike)
                continue
            full, used = unit.gather_full(shard[0]), unit.grads.used
        else:
            full, used = unit.grads.flat, [p.grad is not None for p in unit.params]
        for name, view, has, trainable in zip(unit.param_names, unit.layout.views(full), used, unit.trainable):
            if has and trainable:
                out[name] = view.detach().clone()
    return out
