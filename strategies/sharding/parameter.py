"""What a sharded parameter is between uses: the same Parameter object, whose every read is a clear error.

Under fsdp a unit's full parameters exist only while the unit computes. In between, each parameter keeps its
identity (the optimizer, hooks and `named_parameters()` still see the same object), its shape, dtype and device,
but its class is switched to `ShardedParameter`, whose `__torch_function__` lets metadata through (shape, dtype,
`.grad`, hashing, ...) and turns every computation into an error that names the parameter and says how to read it.
Switching a Python object's class costs about 100 ns, so units switch on every unshard and reshard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_METADATA = {
    torch.Tensor.__hash__,
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.is_meta.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.requires_grad.__set__,
    torch.Tensor.grad.__get__,
    torch.Tensor.grad.__set__,
    torch.Tensor.data.__get__,
    torch.Tensor.data.__set__,
    torch.Tensor.nbytes.__get__,
    torch.Tensor.itemsize.__get__,
    torch.Tensor.size,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.untyped_storage,  # a sharded parameter's storage holds no bytes
    torch.Tensor.data_ptr,
    torch.Tensor.is_contiguous,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.requires_grad_,
    torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook,
}


class ShardedParameterError(RuntimeError):
    pass


class _Refuses:
    """A tensor class whose metadata can be read but whose every computation raises `refusal`."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        refusing = next(a for a in _flat(args, kwargs) if isinstance(a, _Refuses))
        raise ShardedParameterError(refusing.refusal(getattr(func, "__name__", str(func))))

    def refusal(self, operation: str) -> str:
        raise NotImplementedError


class ShardedParameter(_Refuses, nn.Parameter):
    """The class a parameter has while its unit is sharded (see the module docstring)."""

    _sharded_name: str
    _sharded_unit: str
    _sharded_world_size: int

    def refusal(self, operation: str) -> str:
        return (
            f"parameter {self._sharded_name!r} is sharded across {self._sharded_world_size} rank(s): its unit "
            f"{self._sharded_unit!r} gathers it only while the unit runs forward or backward, so it cannot be "
            f"read here ({operation}). Call the model, or read it inside `with strategy.unsharded(module):` "
            "(every rank), or take `strategy.full_state_dict()`."
        )

    def __repr__(self) -> str:
        return f"ShardedParameter({self._sharded_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _flat(args: tuple, kwargs: dict | None) -> Iterator[Any]:
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def label_sharded(param: nn.Parameter, name: str, unit: str, world_size: int) -> None:
    """What a read of `param` names while it is sharded: set once, after which `mark_sharded` only changes its
    class (each unit does so twice per step)."""
    param._sharded_name, param._sharded_unit, param._sharded_world_size = name, unit or "<root>", world_size


def mark_sharded(params: list[nn.Parameter]) -> None:
    """Make every read of these parameters (labelled: label_sharded) an error that names them; only plain
    nn.Parameters (subclasses are left alone)."""
    for param in params:
        if type(param) is nn.Parameter:
            param.__class__ = ShardedParameter


def mark_unsharded(params: list[nn.Parameter]) -> None:
    for param in params:
        if type(param) is ShardedParameter:
            param.__class__ = nn.Parameter


@contextmanager
def readable(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Let the engine itself read and write `params` (their data must be real meanwhile)."""
    marked = [p for p in params if type(p) is ShardedParameter]
    for p in marked:
        p.__class__ = nn.Parameter
    try:
        yield
    finally:
        for p in marked:
            p.__class__ = ShardedParameter


def metadata_access() -> Any:
    """A context in which the engine reads and sets `.grad` (and other metadata) of many placeholders at once
    without going through their `__torch_function__` (several microseconds per access, per parameter); no
    computation may run inside it."""
    return torch._C.DisableTorchFunctionSubclass()
