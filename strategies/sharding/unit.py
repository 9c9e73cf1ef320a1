"""A unit: a group of parameters that is communicated together.

Under fsdp a unit is a module chosen by the wrap policy (its parameters are all-gathered before it computes and
freed after); under ddp, zero1 and zero2 a unit is a gradient bucket. Either way the unit owns one flat buffer of
its parameters (see layout.py) and its gradients: a flat bucket of the same layout when gradients are replicated,
this rank's gradient shard when they are sharded (reduce-scattered straight from each parameter's .grad). When
optimizer state is sharded, this rank's slices of parameters and gradients are the tensors the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, Work, all_gather, all_reduce_sum, reduce_scatter_parts, wait
from .layout import FlatLayout, Piece
from .spec import ShardingSpec, UnitOptions


class ParamState(Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


class ShardUnit:
    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        spec: ShardingSpec,
        rank: int,
        world_size: int,
        group: Any,
        stats: CommStats,
        module: nn.Module | None = None,
        device: torch.device | None = None,
        options: UnitOptions | None = None,
    ) -> None:
        self.name, self.module, self.spec = name, module, spec
        self.rank, self.world_size, self.group, self.stats = rank, world_size, group, stats
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.trainable = [p.requires_grad for p in self.params]
        self.layout = FlatLayout([p.shape for p in self.params], world_size)
        options = options or UnitOptions()
        self.dtype = self.params[0].dtype  # of the master weights and of checkpoints
        self.compute_dtype = options.param_dtype or self.dtype  # of the gathered parameters
        self.reduce_dtype = options.reduce_dtype or self.compute_dtype
        self.device = device or self.params[0].device
        self.shard_device = torch.device("cpu") if options.offload_to_cpu else self.device
        self._build_parameter_buffers()
        self._build_gradient_buffers()
        self._build_optimizer_shard()
        self.state = ParamState.UNSHARDED
        self._gather_work: Work = None
        self._reduce_work: Work = None
        self._reduce_output: torch.Tensor | None = None
        self.input_dtype: torch.dtype | None = None  # of the last forward's input (full-precision norm units)
        self.reset_backward_state()
        if spec.shard_parameters:
            self.reshard()

    # ---- construction -------------------------------------------------------------------------------
    def _build_parameter_buffers(self) -> None:
        """The flat buffer of full parameters (which every parameter becomes a view of) and, when optimizer
        state is sharded, this rank's master slice. With replicated parameters the owned slice of the full
        buffer is the master; under fsdp the full buffer is freed between uses, so the master is a copy, kept
        in full precision (and in CPU memory with offloading) whatever the compute dtype."""
        full = torch.empty(self.layout.padded_total, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            full[self.layout.total :].zero_()
            for view, p in zip(self.layout.views(full), self.params):
                view.copy_(p.detach())  # (parameters made on the meta device are written later, materialize.py)
        lo, hi = self.layout.shard_range(self.rank)
        if self.spec.shard_parameters:
            self.master = full[lo:hi].clone().to(self.shard_device)
        elif self.spec.shard_optimizer_state:
            self.master = full[lo:hi]
        self.full_flat = full.to(self.compute_dtype)
        for view, p in zip(self.layout.views(self.full_flat), self.params):
            p.data = view
        self._full_nbytes = self.full_flat.untyped_storage().nbytes()

    def _build_gradient_buffers(self) -> None:
        """Replicated gradients live in one flat buffer per unit (the bucket that is all-reduced), each
        parameter's .grad a view of it. Since zero_grad, a region of the bucket is "fresh" (holds this step's
        gradient), "stale" (last step's) or "zero": the first gradient of a step is copied over a stale region
        instead of zero-filling the whole bucket every step and adding to it."""
        self.has_trainable = any(self.trainable)
        self.grad_flat: torch.Tensor | None = None
        if self.has_trainable and not self.spec.shard_gradients:
            self.grad_flat = torch.zeros_like(self.full_flat)
            self._grad_views = self.layout.views(self.grad_flat)
            self._grad_regions = ["zero"] * len(self.params)
            self._attach_grad_views()

    def _attach_grad_views(self) -> None:
        for view, p, trainable in zip(self._grad_views, self.params, self.trainable):
            if trainable:
                p.grad = view

    def clear_stale_gradients(self) -> None:
        """Zero the bucket regions that got no gradient this step, before the bucket is reduced or read."""
        if self.grad_flat is None:
            return
        for index, region in enumerate(self._grad_regions):
            if region == "stale":
                self._grad_views[index].zero_()
                self._grad_regions[index] = "zero"

    def _build_optimizer_shard(self) -> None:
        """This rank's slice of the parameters (fp32 master) and gradients, as the optimizer sees them."""
        self.pieces: list[Piece] = []
        self.shard_params: dict[int, nn.Parameter] = {}
        if not self.spec.shard_optimizer_state:
            return
        lo, hi = self.layout.shard_range(self.rank)
        if self.spec.shard_gradients:
            self.shard_grad = None  # made by the first reduction after zero_grad, freed by zero_grad
        else:
            self.shard_grad = self.grad_flat[lo:hi] if self.grad_flat is not None else None
        self.pieces = self.layout.pieces(self.rank)
        self._pieces_by_rank = [self.layout.pieces(r) for r in range(self.world_size)]
        for piece in self.pieces:
            trainable = self.trainable[piece.param_index]
            shard = nn.Parameter(
                self.master[piece.shard_offset : piece.shard_offset + piece.numel], trainable
            )
            self.shard_params[piece.param_index] = shard
        self.attach_shard_grads()

    def attach_shard_grads(self) -> None:
        """(Re)point each trainable shard parameter's .grad at its slice of the shard gradient (None when there
        is none: the optimizer then skips the parameter)."""
        for piece in self.pieces:
            if self.trainable[piece.param_index]:
                grad = self.shard_grad
                self.shard_params[piece.param_index].grad = (
                    None if grad is None else grad[piece.shard_offset : piece.shard_offset + piece.numel]
                )

    @contextmanager
    def naming_failures(self, what: str) -> Iterator[None]:
        """A collective of this unit that fails (a timeout, a dead peer) says which unit and what it was."""
        try:
            yield
        except RuntimeError as error:
            if type(error) is not RuntimeError and not isinstance(error, dist.DistError):
                raise  # not from a collective (torch.OutOfMemoryError, ...)
            raise type(error)(f"{what} of unit {self.name or '<root>'!r}: {error}") from error

    # ---- parameters: unshard / reshard --------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        if self.state is not ParamState.SHARDED:
            if not async_op:
                self.wait_unshard()
            return
        self.full_flat.untyped_storage().resize_(self._full_nbytes)
        source = self.master.to(self.device, self.compute_dtype, non_blocking=True)
        self._gather_work = all_gather(self.full_flat, source, self.group, self.stats, async_op=True)
        self.state = ParamState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is ParamState.UNSHARDING:
            with self.naming_failures("all-gather of the parameters"):
                wait(self._gather_work)
            self._gather_work = None
            for view, p in zip(self.layout.views(self.full_flat), self.params):
                p.data = view
            self.state = ParamState.UNSHARDED

    def reshard(self) -> None:
        if not self.spec.shard_parameters or self.state is ParamState.SHARDED:
            return
        self.wait_unshard()
        # While sharded, each parameter keeps its shape but reads as zeros from one shared element (stride 0),
        # so code that inspects shapes still works and a stray read never touches freed memory; writes fail.
        zero = torch.zeros((), dtype=self.compute_dtype, device=self.device)
        for p, shape in zip(self.params, self.layout.shapes):
            p.data = zero.expand(shape)
        self.full_flat.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    def write_full_parameter(self, index: int, value: torch.Tensor) -> None:
        """Store a full value of parameter `index`: only this rank's piece when parameters are sharded."""
        with torch.no_grad():
            if self.spec.shard_parameters:
                for piece in self.pieces:
                    if piece.param_index == index:
                        target = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
                        target.copy_(value.reshape(-1)[piece.start : piece.end])
            else:
                offset, n = self.layout.offsets[index], self.layout.numels[index]
                self.full_flat[offset : offset + n].copy_(value.reshape(-1))

    def gather_replicas_after_step(self) -> Work:
        """zero1/zero2: every rank updated its slice of the replicated parameters; start sharing them."""
        lo, hi = self.layout.shard_range(self.rank)
        return all_gather(self.full_flat, self.full_flat[lo:hi], self.group, self.stats, async_op=True)

    # ---- gradients ----------------------------------------------------------------------------------
    def reset_backward_state(self) -> None:
        self.ready_count = 0
        self.grads_ready = not self.has_trainable
        self.backward_started = False
        self.input_grad_done = False
        self.inputs_need_grad = False

    def on_grad_ready(self, index: int) -> bool:
        """A gradient was accumulated into `.grad`; True when the unit's last one arrived. Replicated gradients
        live in the unit's flat buffer; sharded ones stay in `.grad` until the reduction has sent them."""
        p = self.params[index]
        if not self.spec.shard_gradients:
            view = self._grad_views[index]
            if p.grad.data_ptr() != view.data_ptr():  # autograd's own tensor: move it into the bucket
                if self._grad_regions[index] == "fresh":
                    view.add_(p.grad)
                else:
                    view.copy_(p.grad)
                p.grad = view
            self._grad_regions[index] = "fresh"
        self.ready_count += 1
        return self.ready_count == sum(self.trainable)

    def _gradient_parts(self) -> list[list[torch.Tensor]]:
        """Rank r's slice of the unit's padded flat gradient as tensors that concatenate to it: pieces of the
        parameters' `.grad` (in the reduce dtype), zeros where a parameter has none and for the padding."""
        parts = []
        for pieces in self._pieces_by_rank:
            rank_parts = []
            for piece in pieces:
                grad = self.params[piece.param_index].grad
                if grad is None:
                    rank_parts.append(torch.zeros(piece.numel, dtype=self.reduce_dtype, device=self.device))
                else:
                    rank_parts.append(grad.reshape(-1)[piece.start : piece.end].to(self.reduce_dtype))
            filled = sum(piece.numel for piece in pieces)
            if filled < self.layout.shard_size:
                rank_parts.append(torch.zeros(self.layout.shard_size - filled, dtype=self.reduce_dtype,
                                              device=self.device))
            parts.append(rank_parts)
        return parts

    def launch_reduce(self, sync: bool) -> None:
        """Start averaging this unit's gradients across ranks (or skip it under no_sync)."""
        if not self.has_trainable or not sync:
            return
        self.clear_stale_gradients()
        if self.spec.shard_gradients:
            self._reduce_output = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=self.device)
            self._reduce_work = reduce_scatter_parts(
                self._reduce_output, self._gradient_parts(), self.group, self.stats, async_op=True
            )
        else:
            self._reduce_work = all_reduce_sum(self.grad_flat, self.group, self.stats, async_op=True)

    def finish_reduce(self) -> None:
        """Wait for the reduction and leave the averaged gradient where the optimizer reads it."""
        if self._reduce_work is None:
            return
        with self.naming_failures("gradient reduction"):
            wait(self._reduce_work)
        self._reduce_work = None
        if self.spec.shard_gradients:
            reduced = self._reduce_output.to(self.shard_device, self.master.dtype)  # read at once: no non_blocking
            if self.shard_grad is None:  # the first since zero_grad: the averaged output becomes the gradient
                self.shard_grad = reduced.mul_(1.0 / self.world_size)
            else:
                self.shard_grad.add_(reduced, alpha=1.0 / self.world_size)
            self._reduce_output = None
            for p in self.params:
                p.grad = None
        else:
            self.grad_flat.div_(self.world_size)
            # A parameter unused here may have been used on another rank: every region now holds this step's
            # averaged gradient, and every parameter gets it.
            self._grad_regions = ["fresh"] * len(self.params)
            self._attach_grad_views()

    def zero_grad(self) -> None:
        if self.spec.shard_gradients:
            self.shard_grad = None  # as torch's zero_grad(set_to_none=True): no memory held between steps
        elif self.grad_flat is not None:  # as torch's zero_grad(set_to_none=True); the bucket is kept
            for index, p in enumerate(self.params):
                p.grad = None
                if self._grad_regions[index] == "fresh":
                    self._grad_regions[index] = "stale"
        if self.spec.shard_optimizer_state:
            self.attach_shard_grads()

    def local_grad_square_sum(self) -> torch.Tensor:
        """Sum of squared gradient elements this rank is responsible for in a global norm."""
        grad = self.shard_grad if self.spec.shard_optimizer_state else self.grad_flat
        if grad is None:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return grad.float().pow(2).sum().to(self.device)

    def scale_grads_(self, factor: torch.Tensor) -> None:
        grad = self.shard_grad if self.spec.shard_optimizer_state else self.grad_flat
        if grad is not None:
            grad.mul_(factor.to(grad.device))

    def gather_full_master(self) -> torch.Tensor:
        """fsdp: every rank's master slice gathered into a new full-precision flat tensor (for state dicts)."""
        full = torch.empty(self.layout.padded_total, dtype=self.dtype, device=self.device)
        with self.naming_failures("all-gather of the full parameters"):
            all_gather(full, self.master.to(self.device), self.group, self.stats, async_op=False)
        return full
