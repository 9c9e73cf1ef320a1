"""Meta-device initialisation: build the model without memory, then give each rank only its own shards.

A model built under `deferred_init` (fsdp's `configure_model`) is materialized unit by unit, a parameter at a
time: its value is replayed from the record of its construction (init_record.py), exactly what the eager
construction makes, rank 0's value is broadcast, each rank copies out the pieces it owns, and the full-size value
is dropped. Peak memory is one parameter (at most one unit) on top of the shards. Buffers are replayed whole.

Meta tensors that were not recorded (a model built on the meta device by hand) fall back to running each module's
own initialisation (see `initialiser`), one module at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .init_record import InitRecord, storage_key
from .placeholder import readable


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


def _replay_unit(params: list[nn.Parameter], meta_params: dict[int, torch.Tensor], record: InitRecord,
                 device: torch.device, write_back: Callable, group: object, done: set[int]) -> None:
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


def _initialise_by_module(root: nn.Module, meta_params: dict[int, torch.Tensor], device: torch.device,
                          write_back: Callable, group: object, done: set[int]) -> None:
    """Meta tensors without a record: each module's own initialisation, one module at a time."""
    for name, module in root.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in meta_params
               and id(p) not in done]
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
