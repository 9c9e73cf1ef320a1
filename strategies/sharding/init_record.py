"""The record of how a model's meta tensors were made, and its replay on real memory (see deferred_init.py).

Tensors are tracked by their storage: a view, a `.data` or an `nn.Parameter` shares its base's storage, so only
operations that allocate a storage or write into one are recorded, and a tensor is rebuilt from its storage with
its own size, stride and offset. The value of a tensor is its storage's writers replayed in order, and before each
of them the writers of what it reads: the other parameters of the model are never made.

Random operations: the meta device draws no random numbers, so each random operation is also run once when it is
recorded, on scratch CPU tensors of the same shapes, advancing the generator exactly as the eager construction
would (the generator ends where eager code leaves it); the generator's state before it is kept, and replaying sets
that state and puts the generator back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

META, CPU = torch.device("meta"), torch.device("cpu")


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage (its StorageImpl), shared by all its views."""
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class TensorRef:
    """A recorded meta tensor: which storage, and how it views it."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorRef:
        return cls(storage_key(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.storage_offset())

    def view(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(storage, self.offset, self.size,
                                                                            self.stride)


@dataclass(frozen=True)
class Constant:
    """A real tensor an op read (data from Python, say), as it was then: `_version` counts in-place changes."""

    value: torch.Tensor
    version: int

    def checked(self) -> torch.Tensor:
        if self.value._version != self.version:
            raise RuntimeError("a real tensor that a model's initialisation read on the meta device was changed in "
                               "place afterwards, so that initialisation cannot be replayed; pass a copy (.clone())")
        return self.value


@dataclass
class RecordedOp:
    func: Any
    args: tuple
    kwargs: dict
    rng: tuple[torch.Generator, torch.Tensor] | None  # the generator and its state before the op
    fresh: list[tuple[int, TensorRef]]  # (position among the flattened outputs, ref) of new storages
    reads: set[int]  # storage keys of every meta tensor argument
    writes: set[int]  # storage keys it creates or writes


class InitRecord:
    """The operations that made a model's meta tensors, and their replay."""

    def __init__(self) -> None:
        self.ops: list[RecordedOp] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # kept alive, so that no key is ever reused
        self.writers: dict[int, list[int]] = {}  # storage key -> the ops that create or write it, in order
        self.inside = False  # our own code is running (a replay, a recording): its ops are plain ops

    @contextmanager
    def plain(self) -> Iterator[None]:
        """Run torch as usual (no recording, tensors as they are) for the record's own work."""
        previous, self.inside = self.inside, True
        try:
            yield
        finally:
            self.inside = previous

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s value can be replayed (its storage was created while recording)."""
        return tensor.is_meta and storage_key(tensor) in self.writers

    def materialize(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The values of meta `tensors` (as of now), as new CPU tensors: the operations they depend on, replayed."""
        storages: dict[int, torch.UntypedStorage] = {}
        with self.plain():
            for index in sorted(self._closure({storage_key(t) for t in tensors})):
                self._replay(self.ops[index], storages)
            return [TensorRef.of(t).view(storages[storage_key(t)]) for t in tensors]

    def _closure(self, keys: set[int]) -> set[int]:
        """The ops needed for the current contents of the storages `keys`: their writers and, before each writer,
        the writers of what it reads."""
        needed = dict.fromkeys(keys, len(self.ops))  # storage -> replay its writers before this op index
        chosen: set[int] = set()
        pending = list(keys)
        while pending:
            key = pending.pop()
            if key not in self.writers:
                raise ValueError("a tensor of the model was made on the meta device outside the recording "
                                 "(deferred_init), so its value cannot be reproduced")
            for index in (i for i in self.writers[key] if i < needed[key] and i not in chosen):
                chosen.add(index)
                for read in self.ops[index].reads - {key}:
                    if needed.get(read, -1) < index:
                        needed[read] = index
                        pending.append(read)
        return chosen

    def _replay(self, op: RecordedOp, storages: dict[int, torch.UntypedStorage]) -> None:
        def real(x: Any) -> Any:
            if isinstance(x, TensorRef):
                return x.view(storages[x.key])
            if isinstance(x, Constant):
                return x.checked()
            return CPU if isinstance(x, torch.device) and x.type == "meta" else x

        args, kwargs = tree_map(real, (op.args, op.kwargs))
        with torch.no_grad(), _rng_state(op.rng):
            out = op.func(*args, **kwargs)
        outputs = tree_leaves(out)
        for position, ref in op.fresh:
            storages[ref.key] = self._laid_out_as(outputs[position], ref)

    def _laid_out_as(self, value: torch.Tensor, ref: TensorRef) -> torch.UntypedStorage:
        """`value`'s storage, or a copy laid out as the meta tensor was (kernels may choose other strides)."""
        if (tuple(value.stride()), value.storage_offset()) == (ref.stride, ref.offset):
            return value.untyped_storage()
        storage = torch.empty(self.storages[ref.key].nbytes(), dtype=torch.uint8).untyped_storage()
        ref.view(storage).copy_(value)
        return storage

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run `func` on the meta device and record it if it creates or writes a meta storage."""
        metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta]
        rng = self._draw(func, args, kwargs) if torch.Tag.nondeterministic_seeded in func.tags else None
        on_meta = tree_map(lambda x: x.to(META) if isinstance(x, torch.Tensor) and not x.is_meta else x,
                           (args, kwargs))
        out = func(*on_meta[0], **on_meta[1])
        reads = {storage_key(t) for t in metas}
        fresh = [(i, TensorRef.of(o)) for i, o in enumerate(tree_leaves(out))
                 if isinstance(o, torch.Tensor) and o.is_meta and storage_key(o) not in reads]
        writes = {storage_key(t) for t in written(func, args, kwargs) if t.is_meta} | {r.key for _, r in fresh}
        if writes:
            for t in [*metas, *(o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_meta)]:
                self.storages.setdefault(storage_key(t), t.untyped_storage())
            self.ops.append(RecordedOp(func, *tree_map(_reference, (args, kwargs)), rng, fresh, reads, writes))
            for key in writes:
                self.writers.setdefault(key, []).append(len(self.ops) - 1)
        return out

    def _draw(self, func: Any, args: tuple, kwargs: dict) -> tuple[torch.Generator, torch.Tensor]:
        """Run a random op on scratch CPU tensors (its inputs' real values, uninitialised ones for what it
        overwrites) to advance the generator as eager code would; returns the generator and its state before."""
        generator = kwargs.get("generator") or torch.default_generator
        state = generator.get_state()
        overwritten = {id(t) for t in written(func, args, kwargs)}
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta
                and id(t) not in overwritten]
        values = dict(zip(map(id, read), self.materialize(read))) if read else {}

        def scratch(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                return values[id(x)] if id(x) in values else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
            return CPU if isinstance(x, torch.device) and x.type == "meta" else x

        scratch_args, scratch_kwargs = tree_map(scratch, (args, kwargs))
        with torch.no_grad():
            func(*scratch_args, **scratch_kwargs)
        return generator, state


def _reference(x: Any) -> Any:
    """How a recorded op keeps an argument: a meta tensor by its storage, a real one as a constant."""
    if isinstance(x, torch.Tensor):
        return TensorRef.of(x) if x.is_meta else Constant(x, x._version)
    return x


def written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments `func`'s schema says it writes (in-place and out= arguments)."""
    out = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


@contextmanager
def _rng_state(rng: tuple[torch.Generator, torch.Tensor] | None) -> Iterator[None]:
    """Run with the generator at the recorded state, and put it back afterwards: replaying draws nothing."""
    if rng is None:
        yield
        return
    generator, state = rng
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)
