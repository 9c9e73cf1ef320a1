"""What `.grad` of a parameter holds when gradients are sharded (zero2, fsdp): a placeholder of the parameter's
shape and dtype standing for the averaged gradient, of which this rank holds one slice (no memory of its own).

torch's gradient utilities work on it as on the full gradient, as they do on FSDP2's DTensor gradients:
- norms (`torch.linalg.vector_norm`, `Tensor.norm`, `torch._foreach_norm`: what `clip_grad_norm_` calls) are the
  full gradient's: each parameter's norm is combined from every rank's slice. The norms of all parameters are
  combined at once, in one all-reduce, and kept until a gradient changes, so `clip_grad_norm_(model.parameters())`
  costs one small collective. A norm is therefore collective: every rank must ask for it.
- scaling and clamping in place (`mul_`, `div_`, `clamp_`, `zero_` and their foreach forms: what `clip_grad_norm_`
  and `clip_grad_value_` call) apply to this rank's slice, so every slice is clipped.
Every other computation on it is an error that says what works (the class refuses as placeholder.py's do).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .placeholder import ShardedParameterError, _Refuses

if TYPE_CHECKING:
    from .gradients import ShardedGradients
    from .groups import Groups


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
        return (f"the gradient of {self._sharded_name!r} is reduce-scattered: each of the {self._sharded_world_size} "
                f"rank(s) holds only its shard, so it cannot be read here ({operation}). What works on it: "
                "torch.nn.utils.clip_grad_norm_ and clip_grad_value_, norms (.norm(), torch.linalg.vector_norm; "
                "collective: on every rank) and in-place scaling (mul_, div_, clamp_, zero_). Clip with "
                "strategy.clip_gradients(max_norm) or torch's functions; read it in full with "
                "strategy.full_gradients() (every rank), or use ddp / zero1, whose .grad is the full averaged "
                "gradient.")

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
        norms = _finish(local, ord)
        return {(id(store), index): norm for (store, index), norm in zip(entries, norms)}


_REDUCE_OP = {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}


def _local_contribution(part: torch.Tensor, ord: float) -> torch.Tensor:
    """What this rank's slice adds to a p-norm: the sum of |x|^p (the count of non-zeros for p=0), or for the
    infinity norms its max (min) of |x|; an empty slice adds nothing."""
    if part.numel() == 0:
        return torch.tensor(math.inf if ord == -math.inf else 0.0, dtype=part.dtype, device=part.device)
    norm = torch.linalg.vector_norm(part, ord)
    return norm if ord in (0, math.inf, -math.inf) else norm.pow(ord)


def _finish(combined: torch.Tensor, ord: float) -> torch.Tensor:
    return combined if ord in (0, math.inf, -math.inf) else combined.pow(1.0 / ord)


# ---- what torch's functions may do with a ShardedGradient ------------------------------------------------
def _vector_norm(grad: torch.Tensor, ord: float = 2, dim: Any = None, keepdim: bool = False,
                 *, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(grad, ShardedGradient):  # a plain tensor beside placeholders in a foreach list
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(grad, ord, dim, keepdim, dtype=dtype)
    if dim is not None:
        raise _refused(grad, f"vector_norm over dim={dim}")
    store = grad._store()
    norm = store.norms.norm(grad, float(ord))
    norm = norm.to(grad.device, dtype or grad.dtype)
    return norm.reshape([1] * grad.dim()) if keepdim else norm


def _tensor_norm(grad: torch.Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
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
            raise ValueError("a sharded gradient can be scaled in place by a number or a one-element tensor only, "
                             f"got a tensor of shape {tuple(value.shape)}")
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
