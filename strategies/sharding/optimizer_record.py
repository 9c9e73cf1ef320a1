"""A sharded optimizer's own `state_dict()` holds this rank's shard only: it says so, and `load_state_dict` refuses
a shard of another rank or layout.

The habit from DDP, saving `optimizer.state_dict()` on rank 0 and loading it on every rank, would otherwise give
each rank rank 0's moments (same shapes, no error). The record names the rank, the number of ranks sharing the
state and a fingerprint of the flat layout (which parameters, in which units, which slice this rank owns).
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Protocol

import torch

RECORD = "shardtrain_shard"  # the key added to a sharded optimizer's state_dict()


class _Engine(Protocol):
    """What the record reads of the engine (engine.py's ShardingEngine, which imports this module)."""

    units: list[Any]
    rank: int
    world_size: int

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]: ...


def mark_state_dicts(
    engine: _Engine, optimizer: torch.optim.Optimizer, sharded: bool = True, split: tuple[int, int] | None = None
) -> list[Any]:
    """Add the record to `optimizer.state_dict()` and check it in `load_state_dict`; returns the hooks' handles.
    `sharded`: the state is this rank's shard over the data-parallel ranks; `split`: (rank, ranks) of the
    tensor-parallel ranks, each holding the state of its own pieces of the split parameters."""
    record = _record(engine, optimizer) if sharded else {}
    if split is not None:
        record["tensor_parallel_rank"], record["tensor_parallel_ranks"] = split

    def add(_optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        return {**state_dict, RECORD: dict(record)}

    def check(_optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        _check(record, state_dict.get(RECORD))
        return {k: v for k, v in state_dict.items() if k != RECORD}

    return [optimizer.register_state_dict_post_hook(add), optimizer.register_load_state_dict_pre_hook(check)]


def _record(engine: _Engine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    ids = {id(p) for p in engine.optimizer_parameters(optimizer)}
    layout = [
        (
            unit.name,
            [n for n, p in zip(unit.param_names, unit.params) if id(p) in ids],
            [list(s) for s in unit.layout.shapes],
            [(a, b) for _, a, b in unit.layout.owned(unit.rank)],
        )
        for unit in engine.units
    ]
    return {"rank": engine.rank, "ranks": engine.world_size, "layout": f"{zlib.crc32(json.dumps(layout).encode()):08x}"}


def _check(mine: dict[str, Any], saved: dict[str, Any] | None) -> None:
    if "tensor_parallel_rank" in mine:
        _check_split(mine, saved)
    if "rank" not in mine:
        return
    where = f"this optimizer steps rank {mine['rank']}'s shard of the optimizer state of {mine['ranks']} ranks"
    advice = (
        "A sharded optimizer's state_dict() is one rank's shard. Save model and optimizer together with "
        "strategy.save(path, {'model': model, 'optimizer': optimizer}) and restore them with "
        "strategy.load(path, state), which reshards across strategies and world sizes; or let every rank "
        "save and load its own state_dict() (a file per rank) under the same strategy and world size."
    )
    if saved is None:
        raise ValueError(
            f"optimizer.load_state_dict: {where}, but this state dict is not a shard (a whole "
            f"optimizer's, from one process or ddp?). {advice}"
        )
    if (saved.get("rank"), saved.get("ranks")) != (mine["rank"], mine["ranks"]):
        raise ValueError(
            f"optimizer.load_state_dict: {where}, but this state dict holds rank {saved.get('rank')}'s "
            f"shard of {saved.get('ranks')} ranks. {advice}"
        )
    if saved.get("layout") != mine["layout"]:
        raise ValueError(
            f"optimizer.load_state_dict: {where}, but this state dict is a shard of another layout "
            "(another model, wrap policy or strategy shards the parameters differently). " + advice
        )


def _check_split(mine: dict[str, Any], saved: dict[str, Any] | None) -> None:
    """Under tensor parallel: the state dict must be of the same tensor-parallel rank (the same pieces)."""
    key = ("tensor_parallel_rank", "tensor_parallel_ranks")
    if saved is None or (saved.get(key[0]), saved.get(key[1])) != (mine[key[0]], mine[key[1]]):
        held = "no tensor-parallel pieces" if saved is None else f"tensor-parallel rank {saved.get(key[0])}'s pieces"
        raise ValueError(
            f"optimizer.load_state_dict: this optimizer steps tensor-parallel rank {mine[key[0]]}'s pieces of the "
            f"split parameters (of {mine[key[1]]}), but this state dict holds {held}: the same shapes, other "
            "values. Save model and optimizer with strategy.save(path, {'model': model, 'optimizer': optimizer}) "
            "and restore them with strategy.load(path, state), or let every rank save and load its own "
            "state_dict()."
        )
