"""Model and optimizer state as pieces keyed by parameter name, and back.

A piece is {"shape", "dtype", "start", "end", "data"}: elements [start, end) of the flattened parameter `name`
of global `shape`. Each rank reports the pieces it owns (under replication rank 0 reports whole tensors), so
the same format serves every strategy and any checkpoint can be loaded under any layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .engine import ShardingEngine
from .object_gather import gather_to_rank_zero

Pieces = dict[str, dict[str, Any]]


def _piece(shape: torch.Size, start: int, end: int, data: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(shape),
        "dtype": str(data.dtype).removeprefix("torch."),
        "start": start,
        "end": end,
        "data": _standalone(data.detach().reshape(-1).cpu()),
    }


def _standalone(flat: torch.Tensor) -> torch.Tensor:
    """`flat` itself when it is all of its storage (optimizer state usually is), else a copy: torch.save writes
    a view's whole storage, and the pieces of a flat parameter buffer are views. Pieces are saved or gathered
    right away, so sharing memory with the live tensor is safe and saves a copy of the state during a save."""
    whole = flat.storage_offset() == 0 and flat.untyped_storage().nbytes() == flat.numel() * flat.element_size()
    return flat if whole else flat.clone()


def _owned_pieces(engine: ShardingEngine) -> list[tuple[str, int, int, torch.Tensor, torch.Tensor]]:
    """(name, start, end, parameter data, optimizer parameter) for what this rank is responsible for (the first
    copy only, under hybrid sharding)."""
    out = []
    if engine.groups.replica != 0:
        return out
    for unit in engine.units:
        if engine.spec.shard_optimizer_state:
            for piece in unit.pieces:
                shard = unit.shard_params[piece.param_index]
                out.append((unit.param_names[piece.param_index], piece.start, piece.end, shard, shard))
        elif engine.rank == 0:
            for name, p in zip(unit.param_names, unit.params):
                out.append((name, 0, p.numel(), p, p))
    return out


def _shape_of(engine: ShardingEngine, name: str) -> torch.Size:
    unit, index = engine.unit_of(engine.param_by_name[name])
    return unit.layout.shapes[index]


def model_pieces(engine: ShardingEngine) -> Pieces:
    """This rank's parameter pieces plus, on rank 0, every other state-dict entry (buffers) in full."""
    pieces = {
        name: _piece(_shape_of(engine, name), s, e, data) for name, s, e, data, _ in _owned_pieces(engine)
    }
    if engine.rank == 0 and engine.groups.replica == 0:
        params = {id(p) for p in engine.module.parameters()}
        for key, value in engine.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) not in params:
                pieces[key] = _piece(value.shape, 0, value.numel(), value)
    return pieces


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """State-dict keys of tied parameters that are not their first name: alias -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def load_model_state(engine: ShardingEngine, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (first names of parameters, plus buffers) into the sharded model."""
    engine.write_full_parameters(state)
    params = {id(p) for p in engine.module.parameters()}
    with torch.no_grad():
        for key, value in engine.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) not in params and key in state:
                value.copy_(state[key])


def _is_elementwise(key: str, value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == param.shape


def optimizer_pieces(engine: ShardingEngine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name: per-element state as pieces, scalars (like `step`) as is."""
    owned = _owned_pieces(engine)
    local_name = {id(opt_param): name for name, _, _, _, opt_param in owned}
    state: dict[str, Any] = {}
    for name, start, end, _, opt_param in owned:
        entries = {}
        for key, value in optimizer.state.get(opt_param, {}).items():
            if _is_elementwise(key, value, opt_param):
                entries[key] = _piece(_shape_of(engine, name), start, end, value)
            else:
                entries[key] = value.cpu().clone() if isinstance(value, torch.Tensor) else value
        if entries:
            state[name] = entries
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["param_names"] = [local_name[id(p)] for p in group["params"] if id(p) in local_name]
        groups.append(hyper)
    return {"class": type(optimizer).__name__, "state": state, "param_groups": groups}


def load_optimizer_state(
    engine: ShardingEngine,
    optimizer: torch.optim.Optimizer,
    full_state: dict[str, dict[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:
    """Load optimizer state given in full (name -> key -> full tensor or scalar) into this rank's layout."""
    for group, saved in zip(optimizer.param_groups, param_groups):
        group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
    for unit in engine.units:
        for index, name in enumerate(unit.param_names):
            saved = full_state.get(name)
            target = unit.shard_params.get(index) if engine.spec.shard_optimizer_state else unit.params[index]
            if saved is None or target is None:
                continue
            piece = next((p for p in unit.pieces if p.param_index == index), None)
            state = {}
            for key, value in saved.items():
                if (
                    isinstance(value, torch.Tensor)
                    and key != "step"
                    and value.numel() == unit.layout.numels[index]
                ):
                    flat = value.reshape(-1)
                    value = flat[piece.start : piece.end] if piece is not None else value
                    value = value.to(target.device).clone().view(target.shape)
                elif isinstance(value, torch.Tensor):
                    value = value.clone()
                state[key] = value
            optimizer.state[target] = state


def iter_full_state_dict(engine: ShardingEngine, keep: bool) -> Iterator[dict[str, torch.Tensor]]:
    """The unwrapped model's state-dict entries in full, one unit's parameters at a time (under their first
    name; tied aliases left out), then the other entries (buffers). Collective: every rank must iterate to the
    end; where `keep` is False the entries are not copied out and empty dicts are yielded."""
    for names, views in engine.iter_full_parameters():
        yield {n: v.detach().cpu().clone() for n, v in zip(names, views)} if keep else {}
    if not keep:
        return
    params = {id(p) for p in engine.module.parameters()}
    aliases = parameter_aliases(engine.module)
    rest = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) not in params and key not in aliases:
            rest[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    yield rest


def full_state_dict(engine: ShardingEngine, keep: bool = True) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, gathered unit by unit (collective; {} where `keep` is False)."""
    out: dict[str, torch.Tensor] = {}
    for part in iter_full_state_dict(engine, keep):
        out.update(part)
    if not keep:
        return {}
    for alias, first in parameter_aliases(engine.module).items():
        out[alias] = out[first]
    return {k: out[k] for k in engine.module.state_dict(keep_vars=True)}


def full_state_shapes(engine: ShardingEngine) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every entry of the unwrapped model's state dict, without gathering anything."""
    params = {}
    for unit in engine.units:
        for name, shape in zip(unit.param_names, unit.layout.shapes):
            params[name] = (shape, unit.dtype)
    for alias, first in parameter_aliases(engine.module).items():
        params[alias] = params[first]
    out = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        out[key] = params.get(key) or (value.shape, value.dtype)
    return out


def gather_optimizer_state_pieces(
    engine: ShardingEngine, optimizer: torch.optim.Optimizer
) -> Iterator[list[dict] | None]:
    """Every rank's `optimizer_pieces`, sent to rank 0 one unit's parameters at a time. Collective. Yields, unit
    by unit, the list by rank on rank 0 and None on the others."""
    local = optimizer_pieces(engine, optimizer)
    for unit in engine.units:
        part = {**local, "state": {n: local["state"][n] for n in unit.param_names if n in local["state"]}}
        if engine.groups.data_parallel_size == 1:
            yield [part]
            continue
        yield gather_to_rank_zero(part)
