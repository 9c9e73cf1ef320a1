"""Saving and loading a map of owners of state (`{key: owner}`, the contract of stateful.py), as torchtitan's
`CheckpointManager(states={...})` does. A save and a load go one way down: the caller (the Trainer, a plain
loop's `strategy.save`) -> here -> each owner's `state_dict` / `load_targets` / `load_state_dict` -> DCP
(writer.py, source.py).

Saving, every rank writes its owners' pieces and per-rank states, rank 0 the whole objects and the description
(`meta`). Loading is two steps, so that a checkpoint that does not fit is refused before anything changes:
`Loading(...)` reads what the checkpoint holds for each owner on every rank (objects whole, pieces as meta
tensors); the caller checks it; `load()` fills every owner's targets in place (each rank reading only the chunks
of its own pieces) and hands each owner its state, in the map's order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ..sharding import FlatPieces
from .errors import read_on_every_rank
from .format import META
from .planners import Pickled
from .source import Source, open_source
from .stateful import PerRank, is_sharded
from .writer import CheckpointWriter


# ---- saving -------------------------------------------------------------------------------------------------
def pieces_to_write(states: dict[str, Any], rank: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's part of a checkpoint of `states`, as the writer takes it (with `meta` from rank 0)."""
    out: dict[str, Any] = {}
    for key, owner in states.items():
        if isinstance(owner, PerRank):
            state = owner.state_dict()
            if state is not None:
                out[key] = {str(rank): Pickled(state, f"{key}.{rank}")}
        elif is_sharded(owner):
            out[key] = owner.state_dict()
        elif rank == 0:
            out[key] = Pickled(owner.state_dict(), key)
    if rank == 0 and meta is not None:
        out[META] = Pickled(meta, META)
    return out


def save(
    writer: CheckpointWriter,
    states: dict[str, Any],
    path: str | os.PathLike,
    rank: int,
    meta: dict[str, Any],
    summary: dict[str, Any],
    **options: Any,
) -> None:
    """Write a checkpoint of `states` at `path` (`options`: the writer's async_save, links, on_done, texts).
    Collective."""
    writer.save(pieces_to_write(states, rank, meta), path, summary, **options)


# ---- loading ------------------------------------------------------------------------------------------------
def _listed(stored: str | dict[int, str] | None) -> list[str]:
    """The checkpoint keys an owner's `_stored_key` names."""
    if stored is None:
        return []
    return list(stored.values()) if isinstance(stored, dict) else [stored]


class Loading:
    """A checkpoint being loaded into owners of state: open it, `read` what it holds for them, check that, then
    `load`. Collective.

    Args:
        path: the checkpoint directory or file.
        trust_pickled: unpickle whatever the checkpoint holds (only for a checkpoint whose writer is trusted).

    Attributes:
        source: the checkpoint.
        meta: its description ({} for a plain state dict).
        states: the owners being loaded, by the key their state is stored under (given to `read`).
        saved: what it holds for each of them, where it has their state: a whole object; a per-rank owner's state
            from its source rank; a sharded owner's entries (nested, tensors as meta tensors).
    """

    def __init__(self, path: str | os.PathLike, trust_pickled: bool = False) -> None:
        self.source: Source = open_source(path, trust_pickled)
        self.meta = read_meta_item(self.source)
        self.states: dict[str, Any] = {}
        self.saved: dict[str, Any] = {}

    def stored_keys(self) -> set[str]:
        """The top-level keys the checkpoint holds."""
        return {path[0] for path in self.source.paths.values()}

    def read(self, states: dict[str, Any]) -> dict[str, Any]:
        """Read on every rank what the checkpoint holds for the owners `states` (see `saved`), and return it."""
        self.states = states
        sharded = {key for key, owner in states.items() if is_sharded(owner)}
        stored = {key: self._stored_key(key, owner) for key, owner in states.items() if key not in sharded}
        wanted = [k for ks in stored.values() for k in _listed(ks)] + object_keys(self.source, sharded)
        objects = read_on_every_rank(lambda: self.source.read({k: None for k in wanted}))
        self.saved = {}
        for key, k in stored.items():
            if isinstance(k, dict):  # every source rank's state
                self.saved[key] = {rank: objects[item] for rank, item in k.items()}
            elif k is not None:
                self.saved[key] = objects[k]
        for key in sharded:
            self.saved[key] = entries_under(self.source, key, objects)
        return self.saved

    def _stored_key(self, key: str, owner: Any) -> str | dict[int, str] | None:
        """The key an object owner reads (per rank: that of its source rank; of several source ranks, the keys
        the checkpoint has by rank), if the checkpoint has it."""
        if isinstance(owner, PerRank):
            source_rank = owner.source_rank(self.meta.get("world_size"))
            if isinstance(source_rank, list):
                return {r: f"{key}.{r}" for r in source_rank if f"{key}.{r}" in self.source.paths}
            key = None if source_rank is None else f"{key}.{source_rank}"
        return key if key in self.source.paths else None

    def load(self) -> None:
        """Fill every sharded owner's targets in place, then hand each owner what was read, in the map's order.
        Collective."""
        key_of = {path: key for key, path in self.source.paths.items()}
        plain: dict[str, Any] = {}
        shards: dict[str, Any] = {}
        targets: dict[str, Any] = {}
        for key, owner in self.states.items():
            if is_sharded(owner):
                targets[key] = owner.load_targets(self.saved.get(key, {}))
                for path, target in _leaves(targets[key], (key,)):
                    if path not in key_of:
                        raise ValueError(f"the checkpoint holds no {'.'.join(map(str, path))}")
                    stored = key_of[path]
                    (shards if isinstance(target, FlatPieces) else plain)[stored] = target
        read_on_every_rank(lambda: self.source.read(plain, shards))
        for key, owner in self.states.items():
            if key in targets:
                owner.load_state_dict(targets[key])
            elif key in self.saved:
                owner.load_state_dict(self.saved[key])


def global_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def read_meta_item(source: Source) -> dict[str, Any]:
    """The checkpoint's "meta" ({} for a plain state dict)."""
    return source.read({META: None})[META] if META in source.paths else {}


def object_keys(source: Source, tops: set[str]) -> list[str]:
    """The items under the top-level keys `tops` that are objects, not tensors (read whole by every rank)."""
    return [k for k, p in source.paths.items() if k not in source.tensors and (k in tops or p[0] in tops)]


def entries_under(source: Source, top: str, objects: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint holds under `top`, nested as saved (lists where DCP split a list): tensors as meta
    tensors, objects from `objects`."""
    nested: dict[Any, Any] = {}
    for key, path in source.paths.items():
        if path[0] != top or len(path) < 2 or (key not in source.tensors and key not in objects):
            continue
        node = nested
        for part in path[1:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = source.tensors.get(key, objects.get(key))
    return as_lists(nested)


def as_lists(node: Any) -> Any:
    """Dicts whose keys are the ints 0..n-1 (DCP's split lists) as lists."""
    if not isinstance(node, dict):
        return node
    node = {k: as_lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def _leaves(node: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, node
