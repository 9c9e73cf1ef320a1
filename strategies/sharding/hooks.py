"""Autograd plumbing for fsdp units: notice when a unit's backward starts and when it has finished."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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


def call_after_inputs_grad(
    args: tuple, kwargs: dict, callback: Callable[[], None]
) -> tuple[tuple, dict, bool]:
    """Route the grad-requiring tensor arguments through _AfterInputsGrad. Returns the new arguments and
    whether any input needs a gradient (if none does, the unit's backward ends with its parameters)."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions and not keys:
        return args, kwargs, False
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
