"""A unit: a group of parameters that is communicated together, and which parameters go in which unit.

Under fsdp a unit is a module chosen by the wrap policy (its parameters are all-gathered before it computes and
freed after); under ddp, zero1 and zero2 a unit is a gradient bucket. Either way the unit owns one flat buffer of
its parameters (see layout.py), which every parameter is a view of while unsharded, and a gradient store
(gradients.py) chosen once from the spec. When optimizer state is sharded, this rank's slices of the parameters
(`shard_params`, views of the master) are the tensors the optimizer steps.

Which parameters go in which unit (the second half): buckets for replicated parameters, wrapped modules for fsdp.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, Work, all_gather, never_communicates, wait
from .groups import Groups
from .layout import FlatLayout, Piece
from .parameter import label_sharded, mark_sharded, mark_unsharded, metadata_access
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
        groups: Groups,
        stats: CommStats,
        module: nn.Module | None = None,
        device: torch.device | None = None,
        options: UnitOptions | None = None,
        uninitialised: frozenset[int] = frozenset(),
        *,
        gradient_store: Callable[[ShardUnit], Any],
    ) -> None:
        """`uninitialised`: ids of parameters whose values are written later (made on the meta device: see
        meta_init.py); nothing is copied from them, so their unit's buffers stay untouched until then.
        `gradient_store(unit)` makes the unit's gradient store once its buffers are built (gradients.py's
        `gradient_store`, given by the engine: the stores read the unit, so this module does not import them)."""
        self.name, self.module, self.spec, self.groups, self.stats = name, module, spec, groups, stats
        self.rank, self.world_size = groups.rank, groups.size  # in the shard group
        self._gathers_alone = never_communicates(groups.shard)  # (asked once: every unshard would ask)
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.trainable = [p.requires_grad for p in self.params]
        self.trainable_count = sum(self.trainable)  # gradients that arrive in each backward
        self._trainable_params = [p for p, t in zip(self.params, self.trainable) if t]
        # How the engine learns that the unit's gradients are in (docs/architecture.md, "A unit's backward"): from
        # a hook on each trainable parameter (True), or once for the whole unit, when its backward is over.
        self.tracks_each_gradient = False
        self.forward_pass = -1  # the last forward pass (hooks.py's count) that ran the unit
        self.layout = FlatLayout([p.shape for p in self.params], self.world_size, self.trainable)
        options = options or UnitOptions()
        self.dtype = self.params[0].dtype  # of the master weights and of checkpoints
        self.compute_dtype = options.param_dtype or self.dtype  # of the gathered parameters
        self.reduce_dtype = options.reduce_dtype or self.compute_dtype
        self.device = device or self.params[0].device
        self.shard_device = torch.device("cpu") if options.offload_to_cpu else self.device
        self._build_parameter_buffers(uninitialised)
        self._build_optimizer_shard()
        self.grads = gradient_store(self)
        self.state = ParamState.UNSHARDED
        self._gather_works: list[Work] = []
        self.before_gather: Callable[[ShardUnit], None] | None = None  # the engine's `observing`
        self.input_dtype: torch.dtype | None = None  # of the last forward's input (full-precision norm units)
        self.reset_backward_state()
        if spec.shard_parameters:
            for param_name, p in zip(self.param_names, self.params):
                label_sharded(p, param_name, name, self.world_size)
            self.reshard()

    # ---- construction -------------------------------------------------------------------------------
    def _build_parameter_buffers(self, uninitialised: frozenset[int]) -> None:
        """The flat buffer of full parameters (which every parameter becomes a view of) and, when optimizer
        state is sharded, this rank's master slice. With replicated parameters in full precision the owned slice
        of the full buffer is the master; under fsdp the full buffer is freed between uses, and under mixed
        precision it holds the compute dtype, so the master is then a copy, kept in full precision (and in CPU
        memory with offloading)."""
        full = torch.empty(self.layout.padded_total, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for lo, hi in self.layout.padding_ranges():
                full[lo:hi].zero_()
            for view, p in zip(self.layout.views(full), self.params):
                if id(p) not in uninitialised:
                    view.copy_(p.detach())
        self.master_is_in_full_flat = not self.spec.shard_parameters and self.compute_dtype == self.dtype
        if self.master_is_in_full_flat and self.spec.shard_optimizer_state:  # (a bucket: one segment)
            lo, hi = self.layout.shard_range(self.rank)
            self.master = full[lo:hi]
        elif self.spec.shard_optimizer_state:
            self.master = self._master_copy(full)
        self.full_flat = full.to(self.compute_dtype)
        self._full_views = self.layout.views(self.full_flat)  # made once: they outlive the storage's resizes
        self._gather_views = self._views_to_gather()
        self._full_storage = self.full_flat.untyped_storage()  # (fetched once: each fetch makes a Python object)
        self._full_nbytes = self._full_storage.nbytes()
        self._point_params_at(self._full_views)

    def _views_to_gather(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
        """Per segment, (this rank's place in the full buffer, its master slice, the segment in full, whether the
        slice is moved to the device before it is cast): made once, like the parameters' views, since a view
        cannot be made of a freed buffer."""
        if not self.spec.shard_parameters:
            return []
        views = []
        for segment, lo, hi in self.layout.owned(self.rank):
            master = self.master[segment.shard_start : segment.shard_start + segment.chunk]
            whole = self.full_flat[segment.start : segment.start + segment.chunk * self.world_size]
            own = self.full_flat[lo:hi]
            views.append((own, master, whole, master.device != own.device and master.dtype != own.dtype))
        return views

    def _master_copy(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slices of `full`, on their own: offloaded from a GPU in pinned host memory, so that
        gathering them (`unshard`) is a copy that does not wait for the host."""
        pinned = self.shard_device.type == "cpu" and self.device.type == "cuda"
        master = torch.empty(self.layout.shard_size, dtype=full.dtype, device=self.shard_device, pin_memory=pinned)
        for segment, lo, hi in self.layout.owned(self.rank):
            master[segment.shard_start : segment.shard_start + segment.chunk].copy_(full[lo:hi])
        return master

    def _point_params_at(self, views: list[torch.Tensor]) -> None:
        for view, p in zip(views, self.params):
            p.data = view
        self._at_full_views = views is self._full_views

    def _point_params_at_full_views(self) -> None:
        """The views share the flat buffer's storage object, which `resize_` keeps, so parameters pointed at them
        once stay valid through every reshard and unshard; they are pointed again only after `show_full`."""
        if not self._at_full_views:
            self._point_params_at(self._full_views)

    def _build_optimizer_shard(self) -> None:
        """This rank's pieces of the parameters (views of the master), as the optimizer sees them."""
        self.pieces: list[Piece] = []
        self.shard_params: dict[int, nn.Parameter] = {}
        self.pieces_by_rank = [self.layout.pieces(r) for r in range(self.world_size)]
        if not self.spec.shard_optimizer_state:
            return
        self.pieces = self.pieces_by_rank[self.rank]
        for piece in self.pieces:
            trainable = self.trainable[piece.param_index]
            view = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
            self.shard_params[piece.param_index] = nn.Parameter(view, trainable)

    def naming_failures(self, what: str) -> NamingFailures:
        """A collective of this unit that fails (a timeout, a dead peer) says which unit and what it was."""
        return NamingFailures(self.name, what)

    # ---- parameters: unshard / reshard --------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        if self.state is not ParamState.SHARDED:
            if not async_op:
                self.wait_unshard()
            return
        if self.before_gather is not None:
            self.before_gather(self)
        self._full_storage.resize_(self._full_nbytes)
        for own, master, whole, move_then_cast in self._gather_views:  # in place, as FSDP2: no separate input buffer
            if move_then_cast:
                own.copy_(master.to(own.device, non_blocking=True))  # moved, then cast on the device
            else:
                own.copy_(master, non_blocking=True)  # from pinned memory when offloaded: no wait for the host
            if not self._gathers_alone:  # (otherwise the copy above was the gather)
                work = all_gather(whole, own, self.groups.shard, self.stats, async_op=True, unit=self.name)
                if work is not None:
                    self._gather_works.append(work)
        self.state = ParamState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is ParamState.UNSHARDING:
            if self._gather_works:
                with self.naming_failures("all-gather of the parameters"):
                    for work in self._gather_works:
                        wait(work)
                self._gather_works = []
            self._point_params_at_full_views()
            mark_unsharded(self.params)
            self.state = ParamState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters. Each parameter keeps its object, shape and dtype, but any read of it is an
        error naming it until the unit is gathered again (parameter.py)."""
        if not self.spec.shard_parameters or self.state is ParamState.SHARDED:
            return
        if self._gather_works and any(getattr(work, "abandoned", None) is not None for work in self._gather_works):
            return  # its gather may still write into the buffer: keep it while the run fails
        self.wait_unshard()
        self._full_storage.resize_(0)
        self._mark_sharded()
        self.state = ParamState.SHARDED

    def _mark_sharded(self) -> None:
        self._point_params_at_full_views()
        mark_sharded(self.params)

    def show_full(self, full: torch.Tensor) -> None:
        """Point the parameters at `full` (a gathered flat buffer in master precision) for reading and writing
        by the user; `hide_full` undoes it, after which the unit is sharded."""
        self._point_params_at(self.layout.views(full))
        mark_unsharded(self.params)

    def hide_full(self, full: torch.Tensor, write_back: bool) -> None:
        if write_back:
            with torch.no_grad():
                for segment, lo, hi in self.layout.owned(self.rank):
                    self.master[segment.shard_start : segment.shard_start + segment.chunk].copy_(full[lo:hi])
        self._mark_sharded()

    def write_full_parameter(self, index: int, value: torch.Tensor) -> None:
        """Store a full value of parameter `index`: only this rank's piece when parameters are sharded."""
        with torch.no_grad():
            if not self.master_is_in_full_flat:
                for piece in self.pieces:
                    if piece.param_index == index:
                        target = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
                        target.copy_(value.reshape(-1)[piece.start : piece.end])
            if not self.spec.shard_parameters:
                offset, n = self.layout.offsets[index], self.layout.numels[index]
                self.full_flat[offset : offset + n].copy_(value.reshape(-1))

    def gather_replicas_after_step(self) -> Work:
        """zero1/zero2: every rank updated its slice of the replicated parameters; start sharing them."""
        lo, hi = self.layout.shard_range(self.rank)
        if not self.master_is_in_full_flat:
            self.full_flat[lo:hi].copy_(self.master)  # to the compute dtype
        return all_gather(
            self.full_flat, self.full_flat[lo:hi], self.groups.shard, self.stats, async_op=True, unit=self.name
        )

    def gather_full_master(self) -> torch.Tensor:
        """Every rank's master slice gathered into a new full-precision flat tensor (fsdp, mixed precision)."""
        with self.naming_failures("all-gather of the full parameters"):
            return self.gather_full(self.master)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard` (in this unit's layout) gathered into a new flat tensor: every segment the shard
        covers (a gradient shard, or `master[:trainable_shard_size]`, covers the trainable one only; what it
        does not cover is left uninitialised). Collective."""
        full = torch.empty(self.layout.padded_total, dtype=shard.dtype, device=self.device)
        for segment in self.layout.segments:
            if segment.shard_start + segment.chunk <= shard.numel():
                whole = full[segment.start : segment.start + segment.chunk * self.world_size]
                own = shard[segment.shard_start : segment.shard_start + segment.chunk].to(self.device)
                all_gather(whole, own, self.groups.shard, self.stats, async_op=False, unit=self.name)
        return full

    # ---- backward -----------------------------------------------------------------------------------
    def reset_backward_state(self) -> None:
        self.ready_count = 0
        self.grads_ready = not any(self.trainable)
        self.backward_started = False
        self.input_grad_done = False
        self.inputs_need_grad = False

    def has_every_gradient(self) -> bool:
        """Whether every trainable parameter has a `.grad` (after the placeholders were dropped: a gradient of
        this backward, complete, since autograd accumulates a parameter's gradient once, when all of it is in)."""
        with metadata_access():
            return all(p.grad is not None for p in self._trainable_params)

    def on_grad_ready(self, index: int) -> bool:
        """A gradient was accumulated into `.grad`; True when the unit's last one arrived."""
        self.grads.on_grad_ready(index)
        self.ready_count += 1
        return self.ready_count == self.trainable_count


class NamingFailures:
    """`ShardUnit.naming_failures`'s context: a class, not a generator, since it wraps every wait of every unit
    at every step (a generator-based context manager costs a few microseconds more each time)."""

    __slots__ = ("unit", "what")

    def __init__(self, unit: str, what: str) -> None:
        self.unit, self.what = unit, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, _traceback: Any) -> bool:
        if error is None or not isinstance(error, RuntimeError):
            return False
        if type(error) is not RuntimeError and not isinstance(error, dist.DistError):
            return False  # not from a collective (torch.OutOfMemoryError, ...)
        raise type(error)(f"{self.what} of unit {self.unit or '<root>'!r}: {error}") from error


# ---- which parameters go in which unit ---------------------------------------------------------------------
BUCKET_ELEMENTS = 25 * 1024 * 1024 // 4  # like torch DDP's 25 MiB buckets, in fp32 elements

NamedParams = list[tuple[str, nn.Parameter]]
NORM_LAYERS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def full_precision_norm_units(root: nn.Module, chosen: set[str]) -> set[str]:
    """Under mixed precision, the normalization layers not already chosen as units become units of their own, kept
    in full precision (layer statistics are fragile in bf16/fp16)."""
    return {name for name, m in root.named_modules() if name and isinstance(m, NORM_LAYERS)} - chosen


def unique_named_parameters(root: nn.Module) -> NamedParams:
    """Each parameter once, under the first name it is registered with (tied weights share one entry)."""
    return list(root.named_parameters())


def gradient_buckets(root: nn.Module, bucket_elements: int = BUCKET_ELEMENTS) -> list[NamedParams]:
    """Parameters in reverse registration order (roughly the order backward produces their gradients), cut into
    buckets of at most `bucket_elements` of one dtype, device and kind: frozen parameters get buckets of their own,
    which are never reduced, so each trainable bucket is split evenly over the ranks (layout.py)."""
    buckets: list[NamedParams] = []
    filling: dict[tuple, tuple[NamedParams, int]] = {}  # by kind: the bucket being filled and its size
    for name, p in reversed(unique_named_parameters(root)):
        kind = (p.dtype, p.device, p.requires_grad)
        current, size = filling.get(kind, ([], 0))
        if current and size + p.numel() > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        filling[kind] = (current + [(name, p)], size + p.numel())
    buckets += [bucket for bucket, _ in filling.values()]
    order = {id(p): i for i, (_, p) in enumerate(reversed(unique_named_parameters(root)))}
    return sorted(buckets, key=lambda bucket: order[id(bucket[0][1])])


def policy_modules(root: nn.Module, policy: Callable[[nn.Module, str], bool] | None) -> list[tuple[str, nn.Module]]:
    """Modules the policy makes units, in registration order, plus modules marked by hand; never the root."""
    chosen = []
    for name, module in root.named_modules():
        if not name:
            continue
        if getattr(module, "_shard_unit", False) or (policy is not None and policy(module, name)):
            chosen.append((name, module))
    return chosen


def _ancestors(unit_names: list[str], module_name: str) -> list[str]:
    """Unit names that contain `module_name` (the root, "", contains everything), shallowest first."""
    return [u for u in unit_names if u == "" or module_name == u or module_name.startswith(u + ".")]


def assign_to_units(root: nn.Module, unit_names: list[str]) -> dict[str, NamedParams]:
    """Each parameter goes to the deepest unit that contains every module using it, so a tied parameter
    (an embedding shared with the output head, say) lives in one unit that is gathered for both uses."""
    unit_names = [""] + sorted(unit_names, key=lambda n: n.count(".") + 1 if n else 0)
    holders: dict[int, list[str]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(module_name)
    assigned: dict[str, NamedParams] = {name: [] for name in unit_names}
    for name, p in unique_named_parameters(root):
        common = set(unit_names)
        for holder in holders[id(p)]:
            common &= set(_ancestors(unit_names, holder))
        owner = max(common, key=lambda n: (n.count(".") + 1 if n else 0, len(n)))
        assigned[owner].append((name, p))
    return assigned


def mark_as_unit(module: nn.Module) -> nn.Module:
    """Make `module` an FSDP unit by hand, whatever the `auto_wrap_policy` says (call it in `configure_model`).

    Args:
        module: a submodule of the model (the model itself is always the last unit).

    Returns:
        `module`, marked.
    """
    module._shard_unit = True
    return module
