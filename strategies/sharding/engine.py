"""The sharding engine: one object that holds a model's units and drives them from hooks, as FSDP2 does.

After the engine is built the model stays an ordinary module, driven by plain torch:
- forward: under fsdp each unit gathers its parameters around its own forward; modules outside every wrapped unit
  gather the root unit (the parameters no wrapped unit holds) around theirs (hooks.py);
- `loss.backward()`: gradient hooks start each unit's reduction as soon as its gradients are in, and a callback
  queued on the autograd engine finishes them all when backward ends;
- `optimizer.step()` on the optimizer given to `setup_optimizer`: a post-step hook brings every copy of the
  parameters up to date with the stepped shards; `optimizer.zero_grad()` (and the model's) clears the engine's
  gradients as torch clears `.grad`.

The engine branches on the ShardingSpec only: nothing sharded is DDP, optimizer state sharded is ZeRO-1, gradients
too ZeRO-2, parameters too FSDP full shard.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, collective, one_rank_collectives, wait
from .gradients import (
    GradientNorms,
    ShardedGradient,
    ShardedGradients,
    gradient_store,
    launch_together,
    read_used_flags,
)
from .groups import make_groups
from .hooks import ForwardHooks
from .meta_init import InitRecord, has_meta_buffers, materialize, replace_meta_parameters
from .optimizer_record import mark_state_dicts
from .parameter import mark_unsharded
from .spec import ZERO2, ShardingSpec, UnitOptions
from .step_kind import StepKind, step_kind
from .unit import ShardUnit, assign_to_units, full_precision_norm_units, gradient_buckets, policy_modules
from .whole_tensors import SplitTensor, WholeTensorSteps

WrapPolicy = Callable[[nn.Module, str], bool]
REDUCTIONS_IN_FLIGHT = 1  # sharded-gradient reductions allowed to overlap backward before the oldest is awaited
# Sharded-gradient reductions of consecutive small units are started together as one collective (a collective
# costs a latency whatever its size), until they hold this many bytes; larger units start alone, as soon as ready.
REDUCE_TOGETHER_BYTES = 2**20
# A wrapped fsdp unit's gradients are known to be in once per unit, when its backward ends (False: a hook per
# parameter, as the root's; benchmarks/overhead.py compares the two).
POST_BACKWARD_PER_UNIT = True


class ShardingEngine:
    def __init__(
        self,
        module: nn.Module,
        spec: ShardingSpec,
        group: Any = None,
        wrap_policy: WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        device: torch.device | None = None,
        unit_options: UnitOptions | None = None,
        forward_context: Callable[[], AbstractContextManager] | None = None,
        shard_group_size: int | None = None,
        init_record: InitRecord | None = None,
        every_data_parallel_group: list[list[int]] | None = None,
    ) -> None:
        """`init_record`: how the model's meta tensors were made (meta_init.py); they are replayed exactly.
        `every_data_parallel_group`: under tensor parallel, the ranks of each data-parallel group (groups.py)."""
        self.module, self.spec = module, spec
        self.unit_options = unit_options or UnitOptions()
        _check_options(spec, self.unit_options)
        self.device = device or next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
        meta_ids = replace_meta_parameters(module, self.device)
        self._meta_ids = meta_ids
        self.groups = make_groups(group, shard_group_size, every_data_parallel_group)
        self.split_group: Any = None  # under tensor parallel: the ranks that hold the other pieces (split_elsewhere)
        self._splits: dict[int, SplitTensor] = {}  # by id: the parameters that are such pieces, put together how
        self.whole_tensor_steps: dict[int, WholeTensorSteps] = {}  # by optimizer id: those stepped whole
        self.rank, self.world_size = self.groups.rank, self.groups.size  # within it
        if _nothing_to_shard(spec, self.groups.data_parallel_size, self.unit_options, forward_context):
            # One rank's shard of a unit is the whole unit: gathering and freeing it would only cost copies, hooks
            # and a second copy of the weights. The same numbers and checkpoints come from keeping the parameters
            # in place, as zero2 does (which on one rank keeps nothing else apart either).
            self.spec = ZERO2
        self._full_precision_units: set[str] = set()
        self.stats = CommStats()
        self.optimizers: list[torch.optim.Optimizer] = []
        self._optimizer_groups: dict[int, list[list[nn.Parameter]]] = {}  # the module's parameters, by group
        self.sync_gradients = True
        self.in_backward = False
        self._backward_queued = False
        self._broadcast_buffers()
        self.units = self._build_units(wrap_policy)
        self._unit_of_param = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._share_gradient_norms()
        self._reduce_order = self.units  # built in the order backward is expected to finish them
        self._next_reduce = 0
        self._gathering: list[ShardUnit] = []  # ready small units whose reductions will start together
        self._gathering_bytes = 0
        self._launched: list[list[ShardUnit]] = []  # units whose reductions started together, oldest first
        if meta_ids or has_meta_buffers(module):
            materialize(
                module,
                meta_ids,
                self.device,
                self._write_full_parameter,
                self.groups.everyone,
                init_record,
                [unit.params for unit in self.units],
            )
        self._hooks: list[Any] = []  # removable handles of every hook the engine put on the model
        self._register_grad_hooks()
        self._register_zero_grad(module, None)
        self.forward_hooks = ForwardHooks(self, reshard_after_forward, forward_context)
        if self.spec.shard_parameters or self.unit_options.param_dtype is not None:
            self._hooks += self.forward_hooks.register()
        _ENGINE_OF[module] = weakref.ref(self)

    # ---- setup --------------------------------------------------------------------------------------
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers are the truth (parameters are broadcast per unit, see _build_units)."""
        if self.groups.data_parallel_size > 1:
            for b in (b for b in self.module.buffers() if not b.is_meta):
                with collective("broadcast", "<buffers>", b.numel(), self.groups.everyone):
                    dist.broadcast(b.data, src=self.groups.source, group=self.groups.everyone)

    def _build_units(self, wrap_policy: WrapPolicy | None) -> list[ShardUnit]:
        if self.spec.shard_parameters:
            wrapped = policy_modules(self.module, wrap_policy)
            if self.unit_options.param_dtype is not None:
                wrapped = self._with_norm_units(wrapped)
            assigned = assign_to_units(self.module, [n for n, _ in wrapped])
            modules = dict(wrapped)
            # Gradients become ready in reverse forward order: last-registered units first, the root last.
            groups = [(n, modules[n], assigned[n]) for n, _ in reversed(wrapped)] + [("", self.module, assigned[""])]
        else:
            groups = [(f"bucket{i}", None, b) for i, b in enumerate(gradient_buckets(self.module))]
        units = []
        for name, module, params in groups:
            if params:
                self._broadcast_params(params)
                units.append(self._new_unit(name, params, module))
        return units

    def split_elsewhere(self, params: list[nn.Parameter], group: Any, splits: list[SplitTensor]) -> None:
        """Mark `params` as pieces of larger tensors whose other pieces are on the ranks of `group` (tensor
        parallel), `splits` saying how each is put together: the norms of their gradients that torch's functions
        take (`clip_grad_norm_`) combine over those ranks too, so that every rank clips by the whole model's norm,
        and an optimizer that steps whole tensors steps the whole ones (whole_tensors.py)."""
        wanted = {id(p) for p in params}
        self._splits = {id(p): split for p, split in zip(params, splits)}
        self.split_group, self._split_ranks = group, dist.get_world_size(group)
        for unit in self.units:
            unit.grads.split = {i: group for i, p in enumerate(unit.params) if id(p) in wanted}

    def _share_gradient_norms(self) -> None:
        """The sharded gradients' placeholders combine their norms over the ranks, all units at once."""
        stores = [u.grads for u in self.units if isinstance(u.grads, ShardedGradients)]
        norms = GradientNorms(stores, self.groups, self.device)
        for store in stores:
            store.norms = norms

    def _with_norm_units(self, wrapped: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        """Under mixed precision, normalization layers become units of their own kept in full precision
        (their inputs are cast up and their outputs back down), as layer statistics are fragile in bf16/fp16."""
        chosen = {name for name, _ in wrapped}
        self._full_precision_units = full_precision_norm_units(self.module, chosen)
        keep = chosen | self._full_precision_units
        return [(name, m) for name, m in self.module.named_modules() if name in keep]

    def _broadcast_params(self, params: list[tuple[str, nn.Parameter]]) -> None:
        params = [(n, p) for n, p in params if id(p) not in self._meta_ids]  # broadcast as they materialize
        if self.groups.data_parallel_size > 1 and params:
            flat = torch.cat([p.detach().reshape(-1) for _, p in params])
            dist.broadcast(flat, src=self.groups.source, group=self.groups.everyone)
            offset = 0
            with torch.no_grad():
                for _, p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _new_unit(self, name: str, params: list, module: nn.Module | None) -> ShardUnit:
        options = self.unit_options
        if name in self._full_precision_units:
            options = UnitOptions(offload_to_cpu=options.offload_to_cpu)
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"unit {name or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                "wrap the modules of each dtype as separate units"
            )
        return ShardUnit(
            name,
            params,
            self.spec,
            self.groups,
            self.stats,
            module,
            self.device,
            options,
            frozenset(self._meta_ids),
            gradient_store=gradient_store,
        )

    def _register_grad_hooks(self) -> None:
        """How each unit's gradients are known to be in. A wrapped fsdp unit is told once, when its backward is over
        (`unit_backward_done`, from its inputs' gradients: hooks.py), as FSDP2's post-backward; the root unit and
        gradient buckets, whose parameters are used all over the model, hear of each gradient from a hook on it.
        A wrapped unit that turns out to need the hooks gets them (`track_each_gradient`)."""
        self._unit_index = {id(unit): i for i, unit in enumerate(self.units)}
        self._track_after_backward: list[ShardUnit] = []
        for unit in self.units:
            if not (POST_BACKWARD_PER_UNIT and self._may_finish_as_a_whole(unit)):
                self.track_each_gradient(unit)

    def _may_finish_as_a_whole(self, unit: ShardUnit) -> bool:
        return (
            self.spec.shard_parameters
            and unit.module is not None
            and unit.module is not self.module
            and isinstance(unit.grads, ShardedGradients)
        )

    def track_each_gradient(self, unit: ShardUnit) -> None:
        """From now on hear of each of `unit`'s gradients from a hook on its parameter (not during a backward: the
        count of a backward starts with it). For a unit called twice in one forward, one whose inputs need no
        gradient, one run without recording (reentrant checkpointing) or one whose gradients come after its
        backward (a parameter used outside it)."""
        if unit.tracks_each_gradient:
            return
        unit.tracks_each_gradient = True
        # A tensor's hooks are held from C++, where the garbage collector cannot see a cycle through them, so
        # they reach the engine through a weak reference: a model and engine that are dropped are freed.
        engine, unit_index = weakref.ref(self), self._unit_index[id(unit)]
        for index, p in enumerate(unit.params):
            if p.requires_grad:
                hook = functools.partial(_on_grad_ready, engine, unit_index, index)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
                if self.spec.shard_gradients:
                    self._hooks.append(p.register_hook(functools.partial(_drop_placeholder, engine, unit_index, index)))

    def _register_zero_grad(self, owner: Any, params: list[torch.Tensor] | None) -> None:
        """`owner.zero_grad()` (the model's or an optimizer's) also clears the engine's gradients of `params`
        (all when None): the instance gets a zero_grad of its own that calls the class's first."""
        original = type(owner).zero_grad
        selection = [(self.units.index(unit), indices) for unit, indices in self._select(params)]  # once
        engine = self  # held strongly: the model (and the optimizer) keep their engine alive, so that
        # `model = strategy.setup_module(model)` without keeping the strategy still trains as it says. This is an
        # instance attribute, which the garbage collector sees: a dropped model and engine are still freed.

        def zero_grad(set_to_none: bool = True) -> None:
            original(owner, set_to_none)
            for unit_index, indices in selection:
                engine.units[unit_index].grads.zero(indices, set_to_none)

        owner.zero_grad = zero_grad
        self._hooks.append(_InstanceAttribute(owner, "zero_grad"))

    def release(self) -> None:
        """Hand the model back as an ordinary module: every parameter full, in master precision and in a tensor
        of its own (no view of the engine's buffers), no gradient, no hooks. Collective under fsdp. The next
        strategy to set up the same module (a second Trainer's fit) calls it, as Lightning lets a module be fit
        again by a new Trainer."""
        if self.in_backward:
            raise RuntimeError("the model cannot be handed to another strategy during backward")
        for unit in self.units:
            unit.reshard()
        with torch.no_grad():
            for unit, (_, fulls) in zip(self.units, self.iter_full_parameters()):
                mark_unsharded(unit.params)
                for p, full in zip(unit.params, fulls):
                    p.data = full.detach().clone()
                    p.grad = None
        self.remove_hooks()
        if engine_of(self.module) is self:
            del _ENGINE_OF[self.module]

    def remove_hooks(self) -> None:
        """Detach the engine from the model: after this the model's forward and backward are plain again
        (its parameters keep their current values; under fsdp call it with the parameters gathered)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def forward_gathers(self) -> bool:
        """Whether a forward pass all-gathers parameters (fsdp over more than one rank)."""
        return self.spec.shard_parameters and self.world_size > 1

    def forward_scope(self) -> AbstractContextManager:
        """Run a step method of the whole model (training_step, ...) as one forward pass (fsdp: with the root
        unit gathered, for parameters the method uses directly)."""
        return self.forward_hooks.scope() if self.spec.shard_parameters else nullcontext()

    # ---- backward -----------------------------------------------------------------------------------
    def queue_finish_backward(self) -> None:
        """Finish every reduction when this backward ends (once per backward)."""
        self.in_backward = True
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def unit_backward_done(self, unit: ShardUnit) -> None:
        """A unit told once (not `tracks_each_gradient`): its backward is over. If every trainable parameter has its
        gradient, the unit's reduction may start. If some has none, it may come later (a parameter used outside the
        unit too) or never (unused): the unit waits for the end of backward, and hooks each gradient from then on."""
        if unit.grads_ready:
            return
        if unit.has_every_gradient():
            unit.grads_ready = True
            self._launch_ready_reductions()
        else:
            self._track_after_backward.append(unit)

    def drop_placeholders(self, unit: ShardUnit | None = None) -> None:
        """Before gradients accumulate: the placeholder `.grad` of `unit`'s parameters (of every unit told once, when
        None) are dropped (gradients.py, `hide`); hooked units drop theirs in their hooks."""
        for each in self.units if unit is None else (unit,):
            if not each.tracks_each_gradient:
                each.grads.hide()

    def _on_grad_ready(self, unit: ShardUnit, index: int) -> None:
        self.queue_finish_backward()
        if unit.on_grad_ready(index):
            unit.grads_ready = True
            self._launch_ready_reductions()
            self.forward_hooks.maybe_reshard_after_backward(unit)

    def _launch_ready_reductions(self) -> None:
        """Collectives must be issued in the same order on every rank, so reductions start in a fixed order."""
        if not (self.sync_gradients or self.spec.shard_gradients):
            return  # no_sync: replicated gradients accumulate locally
        while self._next_reduce < len(self._reduce_order) and self._reduce_order[self._next_reduce].grads_ready:
            unit = self._reduce_order[self._next_reduce]
            self._next_reduce += 1
            if not isinstance(unit.grads, ShardedGradients):
                unit.grads.launch()
                continue
            if self._gathering and not _reduce_alike(self._gathering[0], unit):
                self._launch_gathered()
            self._gathering.append(unit)
            self._gathering_bytes += unit.grads.output_size * unit.reduce_dtype.itemsize
            if self._gathering_bytes >= REDUCE_TOGETHER_BYTES:
                self._launch_gathered()
        if self._next_reduce == len(self._reduce_order):
            self._launch_gathered()

    def _launch_gathered(self) -> None:
        if not self._gathering:
            return
        launch_together([unit.grads for unit in self._gathering])
        self._launched.append(self._gathering)
        self._gathering, self._gathering_bytes = [], 0
        if len(self._launched) > REDUCTIONS_IN_FLIGHT:
            # Advance an older reduction now so that its full-size gradients are freed during backward,
            # keeping gradient memory at the shard plus a couple of units, as the ZeRO table expects.
            for unit in self._launched.pop(0):
                unit.grads.advance()

    def finish_backward(self) -> None:
        """Launch the reductions of units whose gradients did not all arrive (unused parameters), wait for all,
        and leave each averaged gradient where the optimizer reads it. Runs at the end of every backward."""
        self._backward_queued = False
        for unit in self.units:
            unit.grads_ready = True
        self._launch_ready_reductions()
        for unit in self.units:
            if unit.backward_started and not unit.input_grad_done and not unit.tracks_each_gradient:
                self._track_after_backward.append(unit)  # backward reached it, but not its inputs
            unit.grads.finish()
            unit.reshard()
            unit.reset_backward_state()
        for unit in self._track_after_backward:
            self.track_each_gradient(unit)
        self._track_after_backward.clear()
        read_used_flags([unit.grads for unit in self.units])  # the host waits for the GPU once, here
        for unit in self.units:
            unit.grads.attach()
        self._next_reduce = 0
        self._launched.clear()
        self.in_backward = False
        if self.sync_gradients:  # running statistics (BatchNorm) follow rank 0's, as with DDP's broadcast_buffers
            self._broadcast_buffers()

    def synchronize(self) -> None:
        """Average what backward passes under no_sync accumulated locally, when the pass that would have done it
        did not happen (a skipped last micro-batch). Sharded gradients were reduced by every pass already."""
        if not self.spec.shard_gradients:
            self.finish_backward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication (replicated gradients accumulate locally; sharded ones still reduce)."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    # ---- optimizer ----------------------------------------------------------------------------------
    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, elementwise_optimizers: Iterable[type] = ()
    ) -> torch.optim.Optimizer:
        """Keep the user's optimizer and parameter groups; with sharded optimizer state, swap each parameter
        for this rank's piece of it so the optimizer only steps (and keeps state for) the local shard, or, when
        its step is not element-wise (step_kind.py), for the whole parameters this rank owns (whole_tensors.py).
        Its step() then updates every copy of the parameters, and its zero_grad() clears the engine's gradients.
        `elementwise_optimizers`: classes the user declares element-wise (checked all the same)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            if id(p) not in self._unit_of_param:
                raise ValueError(
                    "configure_optimizers: the optimizer holds a tensor that is not a parameter "
                    f"of the module (shape {tuple(p.shape)})"
                )
        if optimizer.state:
            raise ValueError("configure_optimizers: the optimizer already has state; return a fresh optimizer")
        whole = self._whole_tensor_steps(optimizer, elementwise_optimizers)
        self.optimizers.append(optimizer)
        self._optimizer_groups[id(optimizer)] = [list(group["params"]) for group in optimizer.param_groups]
        if whole is not None:
            self.whole_tensor_steps[id(optimizer)] = whole
            whole.replace_parameters(optimizer)
        elif self.spec.shard_optimizer_state:
            for group in optimizer.param_groups:
                group["params"] = [shard for p in group["params"] if (shard := self.shard_of(p)) is not None]
        ids = {id(p) for p in params}
        units = [u for u in self.units if any(id(p) in ids for p in u.params)]
        engine = weakref.ref(self)

        def before_step(*_: Any) -> None:
            for unit in units:
                unit.grads.refresh()
            if whole is not None:
                whole.before_step()

        def after_step(*_: Any) -> None:
            if whole is not None:
                whole.after_step()
            if (live := engine()) is not None:
                live.after_parameters_changed(units)

        self._hooks.append(optimizer.register_step_pre_hook(before_step))
        self._hooks.append(optimizer.register_step_post_hook(after_step))
        self._register_zero_grad(optimizer, params)
        split = None if self.split_group is None else (dist.get_rank(self.split_group), self._split_ranks)
        if self.spec.shard_optimizer_state or split is not None:  # its state_dict() is this rank's: say so
            self._hooks += mark_state_dicts(self, optimizer, self.spec.shard_optimizer_state, split)
        return optimizer

    def _whole_tensor_steps(
        self, optimizer: torch.optim.Optimizer, elementwise_optimizers: Iterable[type]
    ) -> WholeTensorSteps | None:
        """How `optimizer` steps: on pieces (None), or on whole tensors; refused when it needs every parameter
        at once and this rank holds only some."""
        pieces = self.spec.shard_optimizer_state or self._splits
        if not pieces:
            return None  # it steps the replicated parameters themselves
        kind = step_kind(optimizer, elementwise_optimizers)
        if kind is StepKind.ELEMENTWISE:
            return None
        if kind is StepKind.WHOLE_MODEL:
            raise ValueError(
                f"{type(optimizer).__name__} steps every parameter at once (its step reads them all together), "
                "but with the optimizer state sharded (zero1, zero2, fsdp and hsdp shard it) or tensor parallel "
                f"each rank holds only part of them. {type(optimizer).__name__} runs under strategy='ddp' or on "
                "one device, without tensor parallel; or choose an optimizer that steps each tensor on its own "
                "(docs/optimizers.md)."
            )
        return WholeTensorSteps(
            optimizer, self._unit_of_param, self.groups, self.spec.shard_optimizer_state, self._splits, self.stats
        )

    @property
    def optimizer_state_bytes(self) -> int:
        return sum(
            v.numel() * v.element_size()
            for opt in self.optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )

    def shard_of(self, param: nn.Parameter) -> nn.Parameter | None:
        unit, index = self._unit_of_param[id(param)]
        return unit.shard_params.get(index)

    def zero_grad(self, params: list[torch.Tensor] | None = None, set_to_none: bool = True) -> None:
        """Clear the gradients of `params` (all when None) as torch's zero_grad does."""
        for unit, indices in self._select(params):
            unit.grads.zero(indices, set_to_none)

    def _select(self, params: list[torch.Tensor] | None) -> list[tuple[ShardUnit, list[int]]]:
        """(unit, indices of `params` in it) for every unit holding some of `params` (all when None)."""
        wanted = None if params is None else {id(p) for p in params}
        selection = []
        for unit in self.units:
            indices = [i for i, p in enumerate(unit.params) if wanted is None or id(p) in wanted]
            if indices:
                selection.append((unit, indices))
        return selection

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """The module's parameters `optimizer` steps (its own holds this rank's pieces of them)."""
        return [p for group in self.optimizer_groups(optimizer) for p in group]

    def optimizer_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        """The module's parameters in each group of `optimizer`, as the user made the groups."""
        if id(optimizer) not in self._optimizer_groups:
            raise ValueError(
                "this optimizer was not given to strategy.setup_optimizer (call it with the optimizer "
                "first, and use the optimizer it returns)"
            )
        return self._optimizer_groups[id(optimizer)]

    def after_parameters_changed(self, units: list[ShardUnit] | None = None) -> None:
        """Bring every copy of the parameters up to date with the (just stepped or loaded) master shards."""
        units = self.units if units is None else units
        if self.spec.shard_parameters:
            for unit in units:
                unit.reshard()
        elif self.spec.shard_optimizer_state:
            self._gather_replicas(units)

    def after_master_pieces_changed(self) -> None:
        """Every rank wrote its own pieces (state_dict.master_pieces) in place: bring every copy up to date. Under
        ddp a rank's pieces are its slices of the replicated parameters, so they are all-gathered too."""
        if self.spec.shard_optimizer_state:
            self.after_parameters_changed()
        else:
            self._gather_replicas(self.units)

    def _gather_replicas(self, units: list[ShardUnit]) -> None:
        """Replicated parameters: every rank's slice of each unit all-gathered from its master (or its own slice)."""
        works = [unit.gather_replicas_after_step() for unit in units]  # all in flight at once
        for unit, work in zip(units, works):
            with unit.naming_failures("all-gather of the updated parameters"):
                wait(work)

    # ---- parameters in full -------------------------------------------------------------------------
    @contextmanager
    def unsharded(self, module: nn.Module | None = None, write_back: bool = True) -> Iterator[None]:
        """Every parameter of `module` (default: the whole model) in full and in master precision, for reading
        and writing in place; on exit each rank keeps its own slice of what was written (so write alike on every
        rank). Collective under fsdp; a no-op for replicated parameters, which are always full."""
        if not self.spec.shard_parameters:
            yield
            return
        if self.in_backward:
            raise RuntimeError("strategy.unsharded() cannot be used during backward")
        wanted = {id(p) for p in (module or self.module).parameters()}
        units = [u for u in self.units if any(id(p) in wanted for p in u.params)]
        for unit in self.units:
            unit.reshard()
        fulls = [unit.gather_full_master() for unit in units]
        for unit, full in zip(units, fulls):
            unit.show_full(full)
        self.forward_hooks.paused = True
        try:
            yield
        finally:
            self.forward_hooks.paused = False
            for unit, full in zip(units, fulls):
                unit.hide_full(full, write_back)

    def iter_full_parameters(self, trainable_only: bool = False) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        """Unit by unit, the full parameter tensors in master precision (names of the first registration); with
        `trainable_only` the trainable ones, and only their segment is gathered (layout.py)."""
        for unit in self.units:
            if trainable_only and not any(unit.trainable):
                continue
            if unit.master_is_in_full_flat:
                full = unit.full_flat
            elif trainable_only:
                with unit.naming_failures("all-gather of the trainable parameters"):
                    full = unit.gather_full(unit.master[: unit.layout.trainable_shard_size])
            else:
                full = unit.gather_full_master()
            views = unit.layout.views(full)
            keep = [i for i, t in enumerate(unit.trainable) if t or not trainable_only]
            yield [unit.param_names[i] for i in keep], [views[i] for i in keep]

    def _write_full_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None:
        unit, index = self._unit_of_param[id(param)]
        unit.write_full_parameter(index, value)


# The engine that set each model up (weakly: a model dropped with its engine leaves nothing behind), so that another
# strategy setting up the same model can first take it back from that engine (release).
_ENGINE_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def engine_of(module: nn.Module) -> ShardingEngine | None:
    """The live engine `module` was set up by, if any."""
    ref = _ENGINE_OF.get(module)
    return ref() if ref is not None else None


def _nothing_to_shard(spec: ShardingSpec, ranks: int, options: UnitOptions, forward_context: Any) -> bool:
    """fsdp on one rank with nothing that needs its units: no mixed precision (units cast), no offloading (units
    move), no activation offloading (a context around each forward), no one-rank collectives (collectives.py)."""
    return (
        spec.shard_parameters
        and ranks == 1
        and options == UnitOptions()
        and forward_context is None
        and not one_rank_collectives()
    )


def _reduce_alike(a: ShardUnit, b: ShardUnit) -> bool:
    """Whether two units' gradient reductions can be one collective."""
    return (a.reduce_dtype, a.device, a.groups.shard) == (b.reduce_dtype, b.device, b.groups.shard)


def _check_options(spec: ShardingSpec, options: UnitOptions) -> None:
    if options.offload_to_cpu and not spec.shard_parameters:
        raise ValueError("CPU offloading needs sharded parameters (fsdp)")
    if options.param_dtype is not None and not spec.shard_optimizer_state:
        raise ValueError(
            "mixed precision needs a sharded optimizer state (zero1, zero2 or fsdp), which keeps the "
            "full-precision master weights"
        )
    if not spec.shard_gradients and options.reduce_dtype not in (None, options.param_dtype):
        raise ValueError(
            "with replicated gradients (zero1) gradients are reduced in param_dtype; leave "
            "reduce_dtype=None or use zero2 / fsdp"
        )


class _InstanceAttribute:
    """A removable handle for an attribute the engine set on an object (like a hook's handle)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = weakref.ref(owner), name

    def remove(self) -> None:
        owner = self.owner()
        if owner is not None and self.name in vars(owner):
            delattr(owner, self.name)


def _drop_placeholder(engine: weakref.ref, unit_index: int, index: int, _grad: torch.Tensor) -> None:
    """Before autograd accumulates a new gradient into `.grad`: a placeholder there is no gradient to add to (the
    previous micro-batch's was reduced into the shard already), so autograd must find None."""
    live = engine()
    if live is not None:
        param = live.units[unit_index].params[index]
        if type(param.grad) is ShardedGradient:
            param.grad = None


def _on_grad_ready(engine: weakref.ref, unit_index: int, index: int, _param: torch.Tensor) -> None:
    live = engine()
    if live is not None:
        live._on_grad_ready(live.units[unit_index], index)
