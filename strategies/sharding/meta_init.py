"""Meta-device initialisation: build the model without memory while recording how its tensors were made, then
give each rank only its own shards, each value replayed on real memory bit for bit as the eager construction made it.

Building (`deferred_init`): inside `deferred_init()` every tensor that would be created on the CPU is created on
the meta device instead (no memory) and every operation that creates or writes such a tensor is recorded
(`InitRecord`), below autograd, as torch's dispatcher calls it: `nn.Linear`'s constructor, the user's `nn.init`
calls and seeds, HuggingFace's `post_init`, peft's adapter initialisation, timm's. Nothing is re-derived from
`reset_parameters()`: what is replayed is what the model's own code did, in its order. (torchdistx's
`deferred_init` did this; this is it rebuilt on torch's public dispatch and function modes.)

To the model's code these tensors look like CPU tensors (`.device`, `.is_meta`): libraries skip their
initialisation on the meta device (HuggingFace's `init_weights`, torch's `trunc_normal_`), and code that moves
tensors to their layer's device must not move them off it. A CPU tensor made from Python data
(`torch.tensor([...])`) stays real, and code that reads a value (`.item()`, `.tolist()`) gets it replayed on
the spot.

The record (`InitRecord`): tensors are tracked by their storage: a view, a `.data` or an `nn.Parameter` shares its
base's storage, so only operations that allocate a storage or write into one are recorded, and a tensor is rebuilt
from its storage with its own size, stride and offset. The value of a tensor is its storage's writers replayed in
order, and before each of them the writers of what it reads: the other parameters of the model are never made.

Random operations: the meta device draws no random numbers, so each random operation is also run once when it is
recorded, on scratch CPU tensors of the same shapes, advancing the generator exactly as the eager construction
would (the generator ends where eager code leaves it); the generator's state before it is kept, and replaying sets
that state and puts the generator back afterwards.

Materializing (`materialize`, run by the engine): a model built under `deferred_init` (fsdp's `configure_model`) is
materialized unit by unit, a parameter at a time: its value is replayed from the record of its construction,
exactly what the eager construction makes, rank 0's value is broadcast, each rank copies out the pieces it owns,
and the full-size value is dropped. Peak memory is one parameter (at most one unit) on top of the shards. Buffers
are replayed whole.

Meta tensors that were not recorded (a model built on the meta device by hand) fall back to running each module's
own initialisation (see `initialiser`), one module at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from .parameter import readable

META, CPU = torch.device("meta"), torch.device("cpu")


# ---- building on the meta device, recording ----------------------------------------------------------------
aten = torch.ops.aten
_PASS_THROUGH = {aten.lift_fresh.default, aten.lift_fresh_copy.default}  # torch.tensor(data): real data
_SCATTER = torch.ops.c10d.scatter_.default
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
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
        # How DTensor's distribute_tensor hands out a split tensor (see `_scatter`): its chunks, by each chunk.
        self._chunks: dict[TensorRef, tuple[torch.Tensor, ...]] = {}
        self._copied_from: dict[TensorRef, torch.Tensor] = {}  # a contiguous copy of a chunk -> the chunk
        self._made_like: dict[int, torch.Tensor] = {}  # storage key -> what `empty_like` took its shape from

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
        if func is _SCATTER:
            return self._scatter(func, args, kwargs)
        if _has_device(func) and _device(kwargs) in (None, CPU):
            kwargs = {**kwargs, "device": META}  # the CPU (the default) is the meta device here
        out = self.record.record(func, args, kwargs)
        self._follow_chunks(func, args, out)
        return out

    def _follow_chunks(self, func: Any, args: tuple, out: Any) -> None:
        """Note where the chunks of a split tensor come from (for `_scatter`)."""
        if func in _SPLITS and isinstance(out, (list, tuple)):
            chunks = tuple(out)
            self._chunks.update({TensorRef.of(c): chunks for c in chunks if c.is_meta})
        elif func is aten.clone.default and args[0].is_meta:
            self._copied_from[TensorRef.of(out)] = args[0]
        elif func is aten.empty_like.default and args[0].is_meta:
            self._made_like[storage_key(out)] = args[0]

    def _scatter(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A scatter of a split tensor's chunks into a tensor made by `empty_like` of one of them: how DTensor's
        `distribute_tensor` gives each rank its piece (torch's tensor parallel splitting a layer on the meta
        device). Every rank built the same tensor here, so the piece it receives is its own chunk of it: recorded
        as a copy of that chunk (the chunk at this rank's place in the scatter's group)."""
        out = func(*args, **kwargs)  # on meta tensors nothing is sent
        rank = dist.ProcessGroup.unbox(args[2]).rank()
        for output in args[0]:
            like = self._made_like.get(storage_key(output)) if output.is_meta else None
            chunk = None if like is None else self._copied_from.get(TensorRef.of(like), like)
            chunks = None if chunk is None else self._chunks.get(TensorRef.of(chunk))
            if chunks is None or chunks[rank].shape != output.shape:
                raise RuntimeError(
                    "a scatter into a tensor on the meta device (deferred_init) that is not an even split of a "
                    "recorded tensor: its value cannot be reproduced; build the model eagerly"
                )
            self.record.record(aten.copy_.default, (output, chunks[rank]), {})
        return out


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


# ---- the record, and its replay ----------------------------------------------------------------------------
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
        return cls(
            storage_key(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        )

    def view(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride
        )


@dataclass(frozen=True)
class Constant:
    """A real tensor an op read (data from Python, say), as it was then: `_version` counts in-place changes."""

    value: torch.Tensor
    version: int

    def checked(self) -> torch.Tensor:
        if self.value._version != self.version:
            raise RuntimeError(
                "a real tensor that a model's initialisation read on the meta device was changed in "
                "place afterwards, so that initialisation cannot be replayed; pass a copy (.clone())"
            )
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
                raise ValueError(
                    "a tensor of the model was made on the meta device outside the recording "
                    "(deferred_init), so its value cannot be reproduced"
                )
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
        on_meta = tree_map(lambda x: x.to(META) if isinstance(x, torch.Tensor) and not x.is_meta else x, (args, kwargs))
        out = func(*on_meta[0], **on_meta[1])
        reads = {storage_key(t) for t in metas}
        fresh = [
            (i, TensorRef.of(o))
            for i, o in enumerate(tree_leaves(out))
            if isinstance(o, torch.Tensor) and o.is_meta and storage_key(o) not in reads
        ]
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
        read = [
            t
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.is_meta and id(t) not in overwritten
        ]
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


# ---- materializing: each rank writes its own shards --------------------------------------------------------
def replace_meta_parameters(root: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """Swap every meta parameter for an uninitialised one on `device` (the same object in every module holding
    it, so tied weights stay tied); returns their ids. torch cannot re-point a meta tensor at real storage, and
    untouched pages of torch.empty cost no resident memory until the engine moves them into its buffers.
    Returns {id: the meta parameter it replaced}: its shape and dtype are the master's, whatever the engine points
    the new parameter at while sharded (a placeholder of the compute dtype under mixed precision)."""
    replaced: dict[int, nn.Parameter] = {}
    metas: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                    metas[id(replaced[id(p)])] = p
                module._parameters[key] = replaced[id(p)]
    return metas


def has_meta_buffers(root: nn.Module) -> bool:
    return any(b.is_meta for b in root.buffers())


def _broadcast(tensor: torch.Tensor, group: object) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group else 0, group=group)


def materialize(
    root: nn.Module,
    meta_params: dict[int, torch.Tensor],
    device: torch.device,
    write_back: Callable[[nn.Parameter, torch.Tensor], None],
    group: object = None,
    record: InitRecord | None = None,
    units: list[list[nn.Parameter]] | None = None,
) -> None:
    """Initialise every meta parameter and buffer of `root`; `write_back(param, full_value)` stores a parameter.
    With the `record` of the construction, the parameters of each of `units` are replayed together."""
    done: set[int] = set()
    if record is not None:
        for params in units or [list(root.parameters())]:
            _replay_unit(params, meta_params, record, device, write_back, group, done)
        _replay_buffers(root, record, device, group)
    _initialise_by_module(root, meta_params, device, write_back, group, done)


def _replay_unit(
    params: list[nn.Parameter],
    meta_params: dict[int, torch.Tensor],
    record: InitRecord,
    device: torch.device,
    write_back: Callable,
    group: object,
    done: set[int],
) -> None:
    """The unit's parameters, a storage at a time (parameters that view one storage together): each replayed,
    broadcast from rank 0, written into this rank's pieces and dropped before the next."""
    by_storage: dict[int, list[nn.Parameter]] = {}
    for p in params:
        if id(p) in meta_params and id(p) not in done and record.covers(meta_params[id(p)]):
            by_storage.setdefault(storage_key(meta_params[id(p)]), []).append(p)
    for group_params in by_storage.values():
        values = record.materialize([meta_params[id(p)] for p in group_params])
        for p, value in zip(group_params, values):
            value = value.to(device)
            _broadcast(value, group)
            write_back(p, value)
            done.add(id(p))
        del values


def _replay_buffers(root: nn.Module, record: InitRecord, device: torch.device, group: object) -> None:
    replayed: dict[int, torch.Tensor] = {}  # a buffer held by several modules is made once
    for module in root.modules():
        for key, b in module._buffers.items():
            if b is not None and (id(b) in replayed or record.covers(b)):
                if id(b) not in replayed:
                    replayed[id(b)] = record.materialize([b])[0].to(device)
                    _broadcast(replayed[id(b)], group)
                module._buffers[key] = replayed[id(b)]


def _initialise_by_module(
    root: nn.Module,
    meta_params: dict[int, torch.Tensor],
    device: torch.device,
    write_back: Callable,
    group: object,
    done: set[int],
) -> None:
    """Meta tensors without a record: each module's own initialisation, one module at a time."""
    for name, module in root.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in meta_params and id(p) not in done]
        buffers = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not own and not buffers:
            continue
        init = initialiser(root, name, module)
        for key in buffers:
            module._buffers[key] = torch.empty_like(module._buffers[key], device=device)
        resting = [p.data for p in own]
        with torch.no_grad(), readable(own):
            for p in own:
                p.data = torch.empty_like(meta_params[id(p)], device=device)  # the master dtype, not p's
            init()
            for p, rest in zip(own, resting):
                if id(p) not in done:  # a tied parameter keeps its first holder's initialisation
                    _broadcast(p.data, group)
                    write_back(p, p.data)
                    done.add(id(p))
                p.data = rest
            for key in buffers:
                _broadcast(module._buffers[key], group)


def initialiser(root: nn.Module, name: str, module: nn.Module) -> Callable[[], None]:
    """How an unrecorded `module` initialises its own parameters and buffers (a best effort: not necessarily what
    its construction did): its `reset_parameters()` (what torch's layers run in their constructors), then, inside
    a HuggingFace model, that model's `_init_weights(module)` (what its `post_init()` runs on each module)."""
    reset = getattr(module, "reset_parameters", None)
    owner = next((m for m in _ancestors(root, name) if callable(getattr(m, "_init_weights", None))), None)
    if reset is None and owner is None:
        raise ValueError(
            f"module {name or '<root>'!r} ({type(module).__name__}) was created on the meta device outside "
            "configure_model and has no reset_parameters() to initialise it; build it in configure_model (whose "
            "construction is recorded and replayed exactly), or define reset_parameters()"
        )

    def init() -> None:
        if reset is not None:
            reset()
        if owner is not None:
            owner._init_weights(module)

    return init


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """`root`'s modules on the path to `name`, the closest first (the module itself included)."""
    path, parts = [root], name.split(".") if name else []
    for part in parts:
        path.append(path[-1].get_submodule(part))
    return path[::-1]
