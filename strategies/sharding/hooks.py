"""fsdp's module hooks: every unit gathers its parameters around its own forward, and again for its backward.

A wrapped unit hooks its module. The root unit (the parameters no wrapped unit holds) is gathered by every module
outside the wrapped units that holds or contains such parameters, and by `scope()`, which the Trainer runs its step
methods in (they may use root parameters directly). The outermost hooked call is one forward pass: it gathers the
root unit and starts prefetching in the previous pass's order, and when no backward will follow (grad disabled) it
frees every unit at its end. With grad enabled the root unit stays gathered until the end of backward (as in
FSDP2), and each wrapped unit is gathered again when the gradient of its output arrives.

Below them, the autograd plumbing they use: notice when a unit's backward starts and when it has finished, and
cast floating inputs to a unit's compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from .collectives import unit_forward
from .unit import ParamState, ShardUnit

if TYPE_CHECKING:
    from .collectives import CommStats
    from .spec import ShardingSpec


SMALL_UNIT_FRACTION = 0.125  # prefetching looks past units smaller than this share of the largest


class _Engine(Protocol):
    """What the hooks use of the engine that drives them (engine.py's ShardingEngine, which imports this module)."""

    module: nn.Module
    units: list[ShardUnit]
    spec: ShardingSpec
    stats: CommStats
    in_backward: bool  # the hooks of a recomputation (activation checkpointing) run during backward
    _full_precision_units: set[str]  # names of the units kept in full precision under mixed precision

    def queue_finish_backward(self) -> None: ...
    def unit_backward_done(self, unit: ShardUnit) -> None: ...
    def track_each_gradient(self, unit: ShardUnit) -> None: ...
    def drop_placeholders(self, unit: ShardUnit | None = None) -> None: ...


class ForwardHooks:
    def __init__(
        self,
        engine: _Engine,
        reshard_after_forward: bool,
        forward_context: Callable[[], AbstractContextManager] | None,
    ) -> None:
        self.engine = engine
        self.reshard_after_forward = reshard_after_forward
        self.forward_context = forward_context  # entered around each forward pass that records for backward
        self.root = next((u for u in engine.units if u.module is engine.module), None)
        self.paused = False  # inside engine.unsharded(): every parameter is already there
        self.depth = 0  # hooked calls in progress
        self.order: list[ShardUnit] = []  # wrapped units in the order this pass ran them
        self.passes = 0  # forward passes begun
        self.pass_records = False  # whether this pass records for a backward
        self.last_order: list[ShardUnit] = []  # the previous pass's, for prefetching
        self._context: AbstractContextManager | None = None
        # The units are fixed once built: their largest size is worked out once (`_ahead` runs for every unit).
        self._small_below = SMALL_UNIT_FRACTION * max((u.layout.padded_total for u in engine.units), default=0)

    def register(self) -> list[Any]:
        if not self.engine.spec.shard_parameters:
            return self._register_input_casts()
        handles = []
        for unit in self.engine.units:
            if unit is not self.root:
                handles += self._hook(unit.module, unit)
        for module in self._root_modules():
            handles += self._hook(module, self.root)
        return handles

    def _register_input_casts(self) -> list[Any]:
        """zero1/zero2 under mixed precision: the replicated parameters are in the compute dtype, so floating
        inputs of every module holding parameters (or containing such) are cast to it, as FSDP2 does."""
        dtype = self.engine.units[0].compute_dtype
        cast = lambda _m, args, kwargs: (cast_floating(args, dtype), cast_floating(kwargs, dtype))  # noqa: E731
        return [m.register_forward_pre_hook(cast, with_kwargs=True) for m in self._root_modules()]

    def _hook(self, module: nn.Module, unit: ShardUnit | None) -> list[Any]:
        handles = [
            module.register_forward_pre_hook(lambda _m, args, kwargs: self.enter(unit, args, kwargs), with_kwargs=True),
            module.register_forward_hook(lambda _m, _args, output: self.exit(unit, output), always_call=True),
        ]
        if unit is not None and unit is self.root and module is self.engine.module:
            gather_root = lambda _m, _args, output: self._gather_root_in_backward(output)  # noqa: E731
            handles.append(module.register_forward_hook(gather_root))
        return handles

    def _root_modules(self) -> list[nn.Module]:
        """The root, and every module outside the wrapped units that holds a root-unit parameter or contains one
        that does (so calling it directly gathers them too)."""
        wrapped = {id(u.module) for u in self.engine.units if u is not self.root and u.module is not None}
        roots = [self.root] if self.root else [u for u in self.engine.units if u.module is None]  # fsdp, or buckets
        root_params = {id(p) for unit in roots for p in unit.params}
        chosen: dict[int, nn.Module] = {}

        def visit(module: nn.Module) -> bool:
            holds = any(p is not None and id(p) in root_params for p in module._parameters.values())
            for child in module.children():
                if id(child) not in wrapped and visit(child):
                    holds = True
            if holds or module is self.engine.module:
                chosen[id(module)] = module
            return holds

        visit(self.engine.module)
        return list(chosen.values())

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Run a step method (training_step, ...) as one forward pass with the root unit gathered."""
        self.enter(self.root, (), {})
        try:
            yield
        finally:
            self.exit(self.root, None)

    # ---- forward ------------------------------------------------------------------------------------
    def enter(self, unit: ShardUnit | None, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.paused:
            return None
        if self.engine.in_backward:  # recomputation under activation checkpointing
            if unit is not None:
                unit.unshard()
            return self._cast_inputs(unit, args, kwargs)
        self.depth += 1
        if self.depth == 1:
            self._start_pass()
        if unit is not None and unit is not self.root:
            unit_forward(unit.name, True)  # (a profiler's named range; nothing unwatched)
        if unit is not None:
            unit.unshard()  # (the root too: an optimizer step inside a pass, as in a GAN's, reshards it)
        if unit is None or unit is self.root:
            return self._cast_inputs(unit, args, kwargs)
        args, kwargs = self._cast_inputs(unit, args, kwargs)
        self.order.append(unit)
        self._prefetch(self._ahead(self.last_order, len(self.order), +1))
        if torch.is_grad_enabled():
            args, kwargs = self._arm_backward(unit, args, kwargs)
        elif self.pass_records:  # not recorded inside a recorded pass: reentrant checkpointing recomputes it later
            self.engine.track_each_gradient(unit)
        return args, kwargs

    def _arm_backward(self, unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Have the unit's inputs call back once their gradients exist (`call_after_inputs_grad`): the unit's
        backward is then over, and (as FSDP2's post-backward) the engine is told once for the unit
        (`unit_backward_done`). Units whose gradients are hooked one by one (`tracks_each_gradient`) need it only
        with a frozen parameter, which has no gradient to say when backward is done with it. A unit called again
        in one pass, or whose inputs need no gradient, has its gradients hooked from now on."""
        if unit.forward_pass == self.passes:
            self.engine.track_each_gradient(unit)
        unit.forward_pass = self.passes
        if unit.tracks_each_gradient and unit.trainable_count == len(unit.params):
            return args, kwargs
        args, kwargs, unit.inputs_need_grad = call_after_inputs_grad(args, kwargs, lambda: self._on_inputs_grad(unit))
        if not unit.inputs_need_grad:
            self.engine.track_each_gradient(unit)
        return args, kwargs

    def exit(self, unit: ShardUnit | None, output: Any) -> Any:
        if self.paused:
            return output
        output = self._cast_output(unit, output)
        if self.engine.in_backward:
            return output
        if unit is not None and unit is not self.root:
            if self.reshard_after_forward and not self._is_last_in_forward(unit):
                unit.reshard()
            if torch.is_grad_enabled():
                call_before_outputs_grad(output, lambda: self._pre_backward(unit))
            unit_forward(unit.name, False)
        self.depth -= 1
        if self.depth == 0:
            self._end_pass()
        return output

    def _start_pass(self) -> None:
        if self.order:
            self.last_order = self.order
        self.order = []
        self.passes += 1
        self.pass_records = torch.is_grad_enabled()
        if self.pass_records:
            self.engine.drop_placeholders()
        if self.root is not None:
            self.root.unshard()
        self._prefetch(self._ahead(self.last_order, 0, +1))
        if self.forward_context is not None and torch.is_grad_enabled():
            self._context = self.forward_context()
            self._context.__enter__()

    def _end_pass(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
        if not torch.is_grad_enabled():  # no backward will come to free them (evaluation, generation)
            for unit in self.engine.units:
                unit.reshard()

    def _cast_inputs(self, unit: ShardUnit | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Under mixed precision floating inputs are cast to the unit's compute dtype (as FSDP2's
        cast_forward_inputs); full-precision units (norm layers) cast their output back to the input's dtype."""
        if unit is None or unit.compute_dtype == unit.dtype and unit.name not in self.engine._full_precision_units:
            return args, kwargs
        if unit.name in self.engine._full_precision_units:
            unit.input_dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        return cast_floating(args, unit.compute_dtype), cast_floating(kwargs, unit.compute_dtype)

    def _cast_output(self, unit: ShardUnit | None, output: Any) -> Any:
        if unit is None or unit.name not in self.engine._full_precision_units or unit.input_dtype is None:
            return output
        return cast_floating(output, unit.input_dtype)

    def _is_last_in_forward(self, unit: ShardUnit) -> bool:
        """Whether `unit` just ran as the last unit of the forward (by the previous pass's order). Backward
        starts with it, so it stays gathered instead of being freed and gathered again (when a backward comes;
        otherwise the next optimizer step or evaluation reshards it)."""
        order, last = self.order, self.last_order
        return torch.is_grad_enabled() and len(order) == len(last) > 0 and order[-1] is unit is last[-1]

    def _ahead(self, order: list[ShardUnit], start: int, step: int) -> list[ShardUnit]:
        """The units to gather ahead: from order[start] on in the direction `step`, up to and including the first
        that is not small. A small unit (a normalization layer kept in full precision is a unit of its own) would
        otherwise be all the look-ahead there is, and the next block's gather would start only when it runs."""
        window = []
        while 0 <= start < len(order):
            window.append(order[start])
            if order[start].layout.padded_total >= self._small_below:
                break
            start += step
        return window

    def _prefetch(self, units: list[ShardUnit]) -> None:
        for unit in units:
            if unit.state is ParamState.SHARDED:
                unit.unshard(async_op=True)

    # ---- a rank without a batch takes part in the others' forward (strategies/step_trace.py) -------
    @contextmanager
    def observing(self, unit_gather: Callable[[int, str], None], collective: Callable[[str], None]) -> Iterator[None]:
        """Inside the block, `unit_gather(unit index, unit name)` hears of each unit's all-gather before it is
        issued, and `collective(kind)` of every collective of the engine (those all-gathers included)."""
        for index, unit in enumerate(self.engine.units):
            unit.before_gather = lambda u, i=index: unit_gather(i, u.name)
        self.engine.stats.observer = collective
        try:
            yield
        finally:
            self.engine.stats.observer = None
            for unit in self.engine.units:
                unit.before_gather = None

    def repeat_gather(self, index: int) -> None:
        """All-gather unit `index`'s parameters and free them again: this rank's part in a forward pass that other
        ranks run and this one does not (it has no batch); see strategies/step_trace.py."""
        unit = self.engine.units[index]
        unit.reshard()
        unit.unshard()
        unit.reshard()

    # ---- backward -----------------------------------------------------------------------------------
    def _pre_backward(self, unit: ShardUnit) -> None:
        self.engine.queue_finish_backward()
        if unit.backward_started:
            return
        unit.backward_started = True
        if not unit.tracks_each_gradient:
            self.engine.drop_placeholders(unit)  # (again: a second backward may follow without a forward)
        unit.unshard()
        if unit in self.order:
            self._prefetch(self._ahead(self.order, self.order.index(unit) - 1, -1))

    def _gather_root_in_backward(self, output: Any) -> None:
        """A second backward through a retained graph (`backward(retain_graph=True)`, then another) finds the root
        unit resharded by the first: it is gathered again when the model's outputs' gradients arrive."""
        if torch.is_grad_enabled() and not self.paused and not self.engine.in_backward:
            call_before_outputs_grad(output, self._root_pre_backward)

    def _root_pre_backward(self) -> None:
        self.engine.queue_finish_backward()
        self.root.unshard()

    def _on_inputs_grad(self, unit: ShardUnit) -> None:
        unit.input_grad_done = True
        if not unit.tracks_each_gradient:
            self.engine.unit_backward_done(unit)
        self.maybe_reshard_after_backward(unit)

    def maybe_reshard_after_backward(self, unit: ShardUnit) -> None:
        if unit is self.root or unit.module is None:
            return  # the root is resharded when backward ends; buckets hold replicated parameters
        if unit.grads_ready and (unit.input_grad_done or not unit.inputs_need_grad):
            unit.reshard()


# ---- autograd plumbing -------------------------------------------------------------------------------------
class _AfterInputsGrad(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs exist,
    which is when the unit's own backward has finished."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _flatten(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flatten(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _flatten(item)]
    return []


def call_after_inputs_grad(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict, bool]:
    """Run `callback` once the gradients of the grad-requiring tensor arguments exist. A single such argument (the
    usual hidden state) is passed on as a view of itself, with `callback` as a pre-hook on the view's autograd node:
    cheaper than an autograd Function (its ctx, its Python forward), and the unit may change its input in place (a
    custom Function's output may not be), which rewrites the history so the hook never runs: the engine then tracks
    the unit's gradients one by one (engine.finish_backward). Several go through _AfterInputsGrad, whose backward
    runs once all their gradients are in. Returns the new arguments and whether any input needs a gradient (if none
    does, the unit's backward ends with its parameters)."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions and not keys:
        return args, kwargs, False
    if len(positions) + len(keys) == 1:
        tensor = args[positions[0]] if positions else kwargs[keys[0]]
        view = tensor.view_as(tensor)
        view.grad_fn.register_prehook(lambda _grads: callback())  # (returns None: the gradient goes on unchanged)
        outputs = (view,)
    else:
        outputs = _AfterInputsGrad.apply(callback, *[args[i] for i in positions], *[kwargs[k] for k in keys])
    args, kwargs = list(args), dict(kwargs)
    for i, out in zip(positions + keys, outputs):
        if isinstance(i, int):
            args[i] = out
        else:
            kwargs[i] = out
    return tuple(args), kwargs, True


def call_before_outputs_grad(output: Any, callback: Callable[[], None]) -> None:
    """Run `callback` when the first gradient for any of the module's outputs arrives: before the autograd node
    that made an output runs (a node's pre-hook costs less to register than a tensor hook, which runs at the same
    moment), or when a leaf output's own gradient arrives."""

    def hook(_grads: Any) -> None:  # (returns None: the gradients go on unchanged)
        callback()

    hooked: list[Any] = []
    for t in _flatten(output):
        if not t.requires_grad:
            continue
        node = t.grad_fn
        if node is None:
            t.register_hook(hook)
        elif not any(node is done for done in hooked):
            node.register_prehook(hook)
            hooked.append(node)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating-point tensor in it (through tuples, lists and dicts) cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(cast_floating(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {key: cast_floating(value, dtype) for key, value in obj.items()}
    return obj
