"""Gather a Python object holding large tensors to rank 0 without pickling the tensors.

`dist.gather_object` pickles every rank's object, rank 0's own included, and pickling a tensor costs about
twice its size in transient memory on each side. Here only a skeleton travels pickled (each tensor replaced by
its shape and dtype); the tensors follow as raw point-to-point messages into buffers rank 0 allocates, and rank 0
keeps its own object as it is. Used to gather checkpoint pieces unit by unit, so that rank 0's memory grows by
about what it keeps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _TensorSlot:
    """Stands for the tensor at `index` in the list sent after the skeleton."""

    def __init__(self, index: int) -> None:
        self.index = index


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor (in dicts, lists and tuples) replaced by a _TensorSlot; the tensors appended."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return _TensorSlot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {key: _split(value, tensors) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(value, tensors) for value in obj)
    return obj


def _join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {key: _join(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(value, tensors) for value in skeleton)
    return skeleton


def gather_to_rank_zero(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (a list by rank), None on the others. Collective over the default group.
    Tensors must be on the CPU (the gloo backend)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensors: list[torch.Tensor] = []
    skeleton = _split(obj, tensors)
    specs = [(t.shape, t.dtype) for t in tensors]
    skeletons: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object((skeleton, specs) if rank != 0 else None, skeletons, dst=0)
    if rank != 0:
        for tensor in tensors:
            if tensor.numel():
                dist.send(tensor, dst=0)
        return None
    gathered = [obj]
    for source in range(1, world_size):
        skeleton, specs = skeletons[source]
        received = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        for tensor in received:
            if tensor.numel():
                dist.recv(tensor, src=source)
        gathered.append(_join(skeleton, received))
    return gathered
