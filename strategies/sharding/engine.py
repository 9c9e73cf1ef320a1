"""The sharding engine: one object that holds a model's units and drives them through a training step.

The engine branches on the ShardingSpec only. With nothing sharded it is DDP (bucketed all-reduce from
backward hooks); with optimizer state sharded it is ZeRO-1; with gradients too, ZeRO-2; with parameters too,
FSDP full shard (units all-gathered around their forward and backward).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, wait
from .hooks import call_after_inputs_grad, call_before_outputs_grad, cast_floating
from .materialize import has_meta_buffers, materialize, replace_meta_parameters
from .spec import ShardingSpec, UnitOptions
from .unit import ParamState, ShardUnit
from .units import assign_to_units, gradient_buckets, policy_modules

WrapPolicy = Callable[[nn.Module, str], bool]
NORM_LAYERS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
REDUCTIONS_IN_FLIGHT = 1  # sharded-gradient reductions allowed to overlap backward before the oldest is awaited


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
    ) -> None:
        self.module, self.spec, self.group = module, spec, group
        self.device = device or next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
        meta_ids = self._meta_ids = replace_meta_parameters(module, self.device)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.reshard_after_forward = reshard_after_forward
        self.unit_options = unit_options or UnitOptions()
        self._full_precision_units: set[str] = set()
        if self.unit_options != UnitOptions() and not spec.shard_parameters:
            raise ValueError("mixed precision and CPU offloading of the engine need sharded parameters (fsdp)")
        self.stats = CommStats()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.sync_gradients = True
        self.in_backward = False
        self._broadcast_buffers()
        self.units = self._build_units(wrap_policy)
        self._unit_of_param = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self.param_by_name = {n: p for u in self.units for n, p in zip(u.param_names, u.params)}
        self._reduce_order = self.units  # built in the order backward is expected to finish them
        self._next_reduce = 0
        self._forward_order: list[ShardUnit] = []
        self._last_forward_order: list[ShardUnit] = []
        if meta_ids or has_meta_buffers(module):
            materialize(module, meta_ids, self.device, self._write_full_parameter, group)
        self._hooks: list[Any] = []  # removable handles of every hook the engine put on the model
        self._register_grad_hooks()
        if spec.shard_parameters:
            self._register_module_hooks()

    # ---- setup --------------------------------------------------------------------------------------
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers are the truth (parameters are broadcast per unit, see _build_units)."""
        if self.world_size > 1:
            for b in (b for b in self.module.buffers() if not b.is_meta):
                dist.broadcast(
                    b.data, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
                )

    def _build_units(self, wrap_policy: WrapPolicy | None) -> list[ShardUnit]:
        if self.spec.shard_parameters:
            wrapped = policy_modules(self.module, wrap_policy)
            if self.unit_options.param_dtype is not None:
                wrapped = self._with_norm_units(wrapped)
            assigned = assign_to_units(self.module, [n for n, _ in wrapped])
            modules = dict(wrapped)
            # Gradients become ready in reverse forward order: last-registered units first, the root last.
            groups = [(n, modules[n], assigned[n]) for n, _ in reversed(wrapped)] + [
                ("", self.module, assigned[""])
            ]
        else:
            groups = [(f"bucket{i}", None, b) for i, b in enumerate(gradient_buckets(self.module))]
        units = []
        for name, module, params in groups:
            if params:
                self._broadcast_params(params)
                units.append(self._new_unit(name, params, module))
        return units

    def _with_norm_units(self, wrapped: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        """Under mixed precision, normalization layers become units of their own kept in full precision
        (their inputs are cast up and their outputs back down), as layer statistics are fragile in bf16/fp16."""
        chosen = {name for name, _ in wrapped}
        self._full_precision_units = {
            name for name, m in self.module.named_modules() if name and isinstance(m, NORM_LAYERS)
        } - chosen
        keep = chosen | self._full_precision_units
        return [(name, m) for name, m in self.module.named_modules() if name in keep]

    def _broadcast_params(self, params: list[tuple[str, nn.Parameter]]) -> None:
        params = [(n, p) for n, p in params if id(p) not in self._meta_ids]  # broadcast as they materialize
        if self.world_size > 1 and params:
            flat = torch.cat([p.detach().reshape(-1) for _, p in params])
            dist.broadcast(
                flat, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
            )
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
            name, params, self.spec, self.rank, self.world_size, self.group, self.stats, module, self.device,
            options,
        )

    def _register_grad_hooks(self) -> None:
        # A tensor's hooks are held from C++, where the garbage collector cannot see a cycle through them, so
        # they reach the engine through a weak reference: a model and engine that are dropped are freed.
        engine = weakref.ref(self)
        for unit_index, unit in enumerate(self.units):
            for index, p in enumerate(unit.params):
                if p.requires_grad:
                    hook = functools.partial(_on_grad_ready, engine, unit_index, index)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _register_module_hooks(self) -> None:
        for unit in self.units:
            if unit.module is self.module:
                continue  # the root is driven by root_call, not by its forward
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda _m, args, kwargs, unit=unit: self._pre_forward(unit, args, kwargs), with_kwargs=True
            ))
            self._hooks.append(unit.module.register_forward_hook(
                lambda _m, _args, out, unit=unit: self._post_forward(unit, out)
            ))

    def remove_hooks(self) -> None:
        """Detach the engine from the model: after this the model's forward and backward are plain again
        (its parameters keep their current values; under fsdp call it with the parameters gathered)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---- forward ------------------------------------------------------------------------------------
    def root_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a step function of the whole model (training_step, validation_step, ...)."""
        if self.spec.shard_parameters:
            if self._forward_order:
                self._last_forward_order = self._forward_order
            self._forward_order = []
            root = self.units[-1]
            if root.module is self.module:
                root.unshard()
            self._prefetch(self._last_forward_order[:1])
        result = fn(*args, **kwargs)
        if self.spec.shard_parameters and not torch.is_grad_enabled():
            for unit in self.units:  # no backward will come to free them (validation, prediction)
                unit.reshard()
        return result

    def _pre_forward(self, unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        unit.unshard()
        if unit.name in self._full_precision_units:
            unit.input_dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
            args, kwargs = cast_floating(args, unit.compute_dtype), cast_floating(kwargs, unit.compute_dtype)
        if self.in_backward:  # recomputation under activation checkpointing
            return args, kwargs
        self._forward_order.append(unit)
        position = len(self._forward_order)
        self._prefetch(self._last_forward_order[position : position + 1])
        if not torch.is_grad_enabled():
            return args, kwargs
        args, kwargs, unit.inputs_need_grad = call_after_inputs_grad(
            args, kwargs, lambda: self._on_inputs_grad(unit)
        )
        return args, kwargs

    def _post_forward(self, unit: ShardUnit, output: Any) -> Any:
        if unit.name in self._full_precision_units and unit.input_dtype is not None:
            output = cast_floating(output, unit.input_dtype)
        if self.in_backward:
            return output
        if self.reshard_after_forward and not self._is_last_in_forward(unit):
            unit.reshard()
        if torch.is_grad_enabled():
            call_before_outputs_grad(output, lambda: self._pre_backward(unit))
        return output

    def _is_last_in_forward(self, unit: ShardUnit) -> bool:
        """Whether `unit` just ran as the last unit of the forward (by the previous step's order). Backward
        starts with it, so it stays gathered instead of being freed and gathered again (when a backward comes;
        otherwise the next optimizer step or evaluation reshards it)."""
        order, last = self._forward_order, self._last_forward_order
        return torch.is_grad_enabled() and len(order) == len(last) > 0 and order[-1] is unit is last[-1]

    def _prefetch(self, units: list[ShardUnit]) -> None:
        for unit in units:
            if unit.state is ParamState.SHARDED:
                unit.unshard(async_op=True)

    # ---- backward -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), then finish every unit's gradient reduction."""
        self.in_backward = False
        loss.backward()
        self.finish_backward()

    def _pre_backward(self, unit: ShardUnit) -> None:
        self.in_backward = True
        if unit.backward_started:
            return
        unit.backward_started = True
        unit.unshard()
        order = self._forward_order
        if unit in order:
            position = order.index(unit)
            self._prefetch(order[position - 1 : position] if position > 0 else [])

    def _on_inputs_grad(self, unit: ShardUnit) -> None:
        unit.input_grad_done = True
        self._maybe_reshard_after_backward(unit)

    def _on_grad_ready(self, unit: ShardUnit, index: int) -> None:
        if unit.on_grad_ready(index):
            unit.grads_ready = True
            self._launch_ready_reductions()
            self._maybe_reshard_after_backward(unit)

    def _maybe_reshard_after_backward(self, unit: ShardUnit) -> None:
        if unit.module is self.module:
            return  # the root is resharded in finish_backward
        if unit.grads_ready and (unit.input_grad_done or not unit.inputs_need_grad):
            unit.reshard()

    def _launch_ready_reductions(self) -> None:
        """Collectives must be issued in the same order on every rank, so reductions start in a fixed order."""
        sync = self.sync_gradients or self.spec.shard_gradients
        while (
            self._next_reduce < len(self._reduce_order) and self._reduce_order[self._next_reduce].grads_ready
        ):
            self._reduce_order[self._next_reduce].launch_reduce(sync)
            self._next_reduce += 1
            if self.spec.shard_gradients and self._next_reduce > REDUCTIONS_IN_FLIGHT:
                # Finish an older reduction now so that its full-size gradient buffer is freed during backward,
                # keeping gradient memory at the shard plus a couple of units, as the ZeRO table expects.
                self._reduce_order[self._next_reduce - 1 - REDUCTIONS_IN_FLIGHT].finish_reduce()

    def finish_backward(self) -> None:
        for unit in self.units:
            unit.clear_stale_gradients()  # before anything reads the buckets: reduction, clipping, loss scaler
            unit.grads_ready = True
        self._launch_ready_reductions()
        for unit in self.units:
            unit.finish_reduce()
            unit.reshard()
            unit.reset_backward_state()
        self._next_reduce = 0
        self.in_backward = False
        if self.sync_gradients:  # running statistics (BatchNorm) follow rank 0's, as with DDP's broadcast_buffers
            self._broadcast_buffers()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication (replicated gradients accumulate locally; sharded ones still reduce)."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    # ---- optimizer ----------------------------------------------------------------------------------
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keep the user's optimizer and parameter groups; with sharded optimizer state, swap each parameter
        for this rank's piece of it so the optimizer only steps (and keeps state for) the local shard."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._unit_of_param:
                    raise ValueError(
                        "configure_optimizers: the optimizer holds a tensor that is not a parameter "
                        f"of the module (shape {tuple(p.shape)})"
                    )
        if optimizer.state:
            raise ValueError(
                "configure_optimizers: the optimizer already has state; return a fresh optimizer"
            )
        self.optimizers.append(optimizer)
        if self.spec.shard_optimizer_state:
            for group in optimizer.param_groups:
                group["params"] = [shard for p in group["params"] if (shard := self.shard_of(p)) is not None]
        return optimizer

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

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global L2 norm over every parameter on every rank is <= max_norm."""
        squares = torch.stack([unit.local_grad_square_sum() for unit in self.units]).sum()
        if self.spec.shard_optimizer_state and self.world_size > 1:
            dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for unit in self.units:
            unit.scale_grads_(coefficient)
        return total

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for unit in self.units:
            unit.clear_stale_gradients()
            if self.spec.shard_optimizer_state:
                unit.attach_shard_grads()
        optimizer.step()
        self.after_parameters_changed()

    def after_parameters_changed(self) -> None:
        """Bring every copy of the parameters up to date with the (just stepped or loaded) master shards."""
        if self.spec.shard_parameters:
            for unit in self.units:
                unit.reshard()
        elif self.spec.shard_optimizer_state:
            works = [unit.gather_replicas_after_step() for unit in self.units]  # all in flight at once
            for unit, work in zip(self.units, works):
                with unit.naming_failures("all-gather of the updated parameters"):
                    wait(work)

    # ---- parameters in full -------------------------------------------------------------------------
    def iter_full_parameters(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        """Unit by unit, the full parameter tensors in master precision (names of the first registration)."""
        for unit in self.units:
            full = unit.gather_full_master() if self.spec.shard_parameters else unit.full_flat
            yield unit.param_names, unit.layout.views(full)

    def _write_full_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None:
        unit, index = self._unit_of_param[id(param)]
        unit.write_full_parameter(index, value)

    def write_full_parameters(self, values: dict[str, torch.Tensor]) -> None:
        """Overwrite every parameter with the given full tensors, keeping the sharded layout."""
        for unit in self.units:
            for index, name in enumerate(unit.param_names):
                unit.write_full_parameter(index, values[name])
            unit.reshard()  # a gathered copy would now be stale

    def unit_of(self, param: nn.Parameter) -> tuple[ShardUnit, int]:
        return self._unit_of_param[id(param)]


def _on_grad_ready(engine: weakref.ref, unit_index: int, index: int, _param: torch.Tensor) -> None:
    live = engine()
    if live is not None:
        live._on_grad_ready(live.units[unit_index], index)
