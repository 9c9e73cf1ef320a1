"""What a user does with the gradients between backward and the optimizer step: read the tensors this rank's
optimizer steps from, clip them (by the global norm over every rank, or by value), and gather them in full for
inspection. (What `.grad` of a parameter holds when gradients are sharded: sharded_gradient.py.)"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import observe
from .engine import ShardingEngine


def gradient_tensors(engine: ShardingEngine, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The gradient tensors this rank's optimizer reads (of `params`, or all), in the master's dtype."""
    wanted = None if params is None else {id(p) for p in params}
    out = []
    for unit in engine.units:
        indices = None if wanted is None else [i for i, p in enumerate(unit.params) if id(p) in wanted]
        if indices != []:
            out += unit.grads.tensors(indices)
    return out


def clip_grad_norm_(engine: ShardingEngine, max_norm: float, params: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Scale gradients (of `params`, or all) so that their global L2 norm over every rank is <= max_norm. The
    norm is computed in the gradients' own dtype (the widest, if they differ), as torch's clip_grad_norm_."""
    grads = gradient_tensors(engine, params)
    squares = [torch.linalg.vector_norm(g).square() for g in grads]
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in squares), torch.float32)
    total = torch.zeros((), dtype=dtype, device=engine.device)
    for square in squares:
        total += square.to(engine.device, dtype)
    if engine.spec.shard_optimizer_state and engine.world_size > 1:
        with observe.collective("all_reduce", "<gradient norm>", 1, engine.groups.shard):
            dist.all_reduce(total, group=engine.groups.shard)
    total = total.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def clip_grad_value_(engine: ShardingEngine, value: float, params: list[torch.Tensor] | None = None) -> None:
    """Clamp every gradient element (of `params`, or all) to [-value, value]; element-wise, so each rank
    clamps what it holds."""
    for grad in gradient_tensors(engine, params):
        grad.clamp_(-value, value)


def full_gradients(engine: ShardingEngine) -> dict[str, torch.Tensor]:
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
