"""Deferred initialisation: build a model on the meta device while recording how its tensors were made, so that
each tensor's value can later be replayed on real memory, bit for bit as the eager construction made it.

Inside `deferred_init()` every tensor that would be created on the CPU is created on the meta device instead
(no memory) and every operation that creates or writes such a tensor is recorded (init_record.py), below
autograd, as torch's dispatcher calls it: `nn.Linear`'s constructor, the user's `nn.init` calls and seeds,
HuggingFace's `post_init`, peft's adapter initialisation, timm's. Nothing is re-derived from
`reset_parameters()`: what is replayed is what the model's own code did, in its order. (torchdistx's
`deferred_init` did this; this is it rebuilt on torch's public dispatch and function modes.)

To the model's code these tensors look like CPU tensors (`.device`, `.is_meta`): libraries skip their
initialisation on the meta device (HuggingFace's `init_weights`, torch's `trunc_normal_`), and code that moves
tensors to their layer's device must not move them off it. A CPU tensor made from Python data
(`torch.tensor([...])`) stays real, and code that reads a value (`.item()`, `.tolist()`) gets it replayed on
the spot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .init_record import CPU, META, InitRecord, written

aten = torch.ops.aten
_PASS_THROUGH = {aten.lift_fresh.default, aten.lift_fresh_copy.default}  # torch.tensor(data): real data
_LOOKS = {torch.Tensor.is_meta.__get__: False, torch.Tensor.is_cpu.__get__: True, torch.Tensor.device.__get__: CPU}
_READS_VALUES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


@contextmanager
def deferred_init() -> Iterator[InitRecord]:
    """Build a model without memory: tensors made inside are meta tensors whose making is recorded; the record
    gives their values on demand (`InitRecord.materialize`)."""
    record = InitRecord()
    with _LooksLikeCPU(record), _Recording(record):
        yield record


class _Recording(TorchDispatchMode):
    """Every op, as the dispatcher runs it: CPU factories made on meta, ops on meta tensors recorded."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PASS_THROUGH or self.record.inside:
            return func(*args, **kwargs)
        with self.record.plain():
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        metas = [t for t in tensors if t.is_meta]
        if not metas and (tensors or not _is_factory(func, kwargs)):
            return func(*args, **kwargs)  # real tensors in, real tensors out
        if _reads_values(func, args, kwargs):
            return func(*_replayed(self.record, args), **_replayed(self.record, kwargs))
        if _has_device(func) and _device(kwargs) in (None, CPU):
            kwargs = {**kwargs, "device": META}  # the CPU (the default) is the meta device here
        return self.record.record(func, args, kwargs)


class _LooksLikeCPU(TorchFunctionMode):
    """Recorded tensors say they are CPU tensors; reading their values (`.tolist()`) replays them first; moving
    them to the CPU keeps them where they are."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.record.inside:
            return func(*args, **kwargs)
        recorded = bool(args) and isinstance(args[0], torch.Tensor) and self.record.covers(args[0])
        if recorded and func in _LOOKS:
            return _LOOKS[func]
        if recorded and func in _READS_VALUES:
            args = (self.record.materialize([args[0]])[0], *args[1:])
        elif recorded and func is torch.Tensor.cpu:
            return args[0]
        elif recorded and func is torch.Tensor.to:
            args, kwargs = tree_map(_cpu_as_meta, (args, kwargs))
        return func(*args, **kwargs)


def _cpu_as_meta(x: Any) -> Any:
    if isinstance(x, (str, torch.device)) and not isinstance(x, torch.dtype):
        try:
            return META if torch.device(x) == CPU else x
        except (RuntimeError, TypeError):
            return x  # a string that is not a device (a memory format's name, say)
    return x


def _device(kwargs: dict) -> torch.device | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


def _has_device(func: Any) -> bool:
    return any(a.name == "device" for a in func._schema.arguments)


def _is_factory(func: Any, kwargs: dict) -> bool:
    """An op that makes a tensor from nothing, on the CPU (the default) or the meta device."""
    return _has_device(func) and _device(kwargs) in (None, CPU, META)


def _reads_values(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` turns a meta tensor's value into something real: `.item()`, `torch.equal`, a copy to a GPU,
    a copy into a real tensor."""
    returns = [str(r.type) for r in func._schema.returns]
    if returns and not any("Tensor" in r for r in returns):  # a Python value (a scalar, a bool)
        return True
    if func is aten._to_copy.default and _device(kwargs) not in (None, CPU, META):
        return True
    return any(not t.is_meta for t in written(func, args, kwargs))


def _replayed(record: InitRecord, tree: Any) -> Any:
    """`tree` with its meta tensors replaced by their replayed values."""
    metas = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_meta]
    values = dict(zip(map(id, metas), record.materialize(metas))) if metas else {}
    return tree_map(lambda x: values.get(id(x), x) if isinstance(x, torch.Tensor) else x, tree)
