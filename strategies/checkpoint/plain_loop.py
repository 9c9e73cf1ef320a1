"""A plain loop's checkpoints, with Lightning Fabric's names: `strategy.save(path, state)` and
`strategy.load(path, state)`.

    strategy.save("ckpt", {"model": model, "optimizer": optimizer, "step": 7, "scheduler": scheduler})
    extra = strategy.load("ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})

The checkpoint is the Trainer's format (a DCP directory with meta.json, written aside and renamed into place): the
model given to `setup_module` and the optimizers given to `setup_optimizer` as each rank's own pieces under their
keys, so that any strategy and world size loads them; every other entry from rank 0, as an object (what has a
`state_dict()`, a scheduler say, as its state dict). Under the key "model" the weights are also what
`trainer.checkpoint.load_full_state_dict` reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..sharding import ShardingEngine
from ..sharding.state_dict import ModelShards, OptimizerShards
from . import checkpointer
from .compatibility import Optimizers, describe, group_names, problems, saved_class
from .format import META
from .writer import CheckpointWriter


def save(
    engine: ShardingEngine | None,
    strategy: str,
    path: str | os.PathLike,
    state: dict[str, Any],
    as_stored: Callable[[Any], Any] = lambda owner: owner,
) -> None:
    """Write `state` as a checkpoint at `path` (`strategy`: its description, for the checkpoint's). Collective:
    every rank calls it with its own objects. `as_stored`: the engine's owners of state as checkpoints hold them
    (under tensor parallel, in the full tensors' coordinates)."""
    model_key, optimizers, objects = _split(engine, state, "save")
    states = _owners(engine, model_key, optimizers, {key: _Object(state, key) for key in objects}, as_stored)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    meta = describe(states[model_key], optimizers, world_size, strategy)
    meta["optimizers"] = [{**d, "key": key} for d, (key, _, _) in zip(meta["optimizers"], optimizers)]
    meta.update({"model_key": model_key, "objects": sorted(objects)})
    step = state.get("step")
    summary = {"world_size": world_size, "global_step": step if isinstance(step, int) else -1}
    checkpointer.save(CheckpointWriter(), states, path, checkpointer.global_rank(), meta, summary)


def load(
    engine: ShardingEngine | None,
    path: str | os.PathLike,
    state: dict[str, Any],
    trust_pickled: bool = False,
    as_stored: Callable[[Any], Any] = lambda owner: owner,
) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint at `path` (of `save` or of the Trainer), resharded to this
    engine's strategy and world size: the model and optimizers in place, objects with `load_state_dict` through
    it, other entries replaced in `state`. Returns every entry of the checkpoint that is not the model or an
    optimizer. Objects are unpickled under the allow-list unless `trust_pickled`. Collective."""
    model_key, optimizers, objects = _split(engine, state, "load")
    loading = checkpointer.Loading(path, trust_pickled)
    _check_keys(loading, path, [model_key, *(key for key, _, _ in optimizers), *objects])
    returned: dict[str, Any] = {}
    stored_objects = {
        key: _Object(state if key in objects else {}, key, returned) for key in _top_level_objects(loading)
    }
    states = _owners(engine, model_key, optimizers, stored_objects, as_stored)
    saved = loading.read(states)
    compared = [
        (optimizer, names, saved.get(key, {}), saved_class(loading.meta, key)) for key, optimizer, names in optimizers
    ]
    found = problems(states[model_key], saved.get(model_key, {}), loading.meta, compared)
    if found:
        raise ValueError(
            f"strategy.load: checkpoint {os.fspath(path)!r} does not fit this model:\n  " + "\n  ".join(found)
        )
    loading.load()
    return returned


def _owners(
    engine: ShardingEngine,
    model_key: str,
    optimizers: Optimizers,
    objects: dict[str, Any],
    as_stored: Callable[[Any], Any],
) -> dict:
    """The checkpoint's owners of state: the engine's shards of the model and optimizers, then the objects."""
    states: dict[str, Any] = {model_key: as_stored(ModelShards(engine))}
    states.update({key: as_stored(OptimizerShards(engine, o, names)) for key, o, names in optimizers})
    return {**states, **objects}


class _Object:
    """An entry of a plain loop's state other than the model and optimizers: saved whole (what has a
    `state_dict()` as its state dict); loaded through its `load_state_dict`, or else replaced in `state`. What
    is loaded is also put in `returned`."""

    def __init__(self, state: dict[str, Any], key: str, returned: dict[str, Any] | None = None) -> None:
        self.state, self.key, self.returned = state, key, returned

    def state_dict(self) -> Any:
        value = self.state[self.key]
        return value.state_dict() if _is_stateful(value) else value

    def load_state_dict(self, state_dict: Any) -> None:
        if self.returned is not None:
            self.returned[self.key] = state_dict
        if self.key not in self.state:
            return
        if _is_stateful(self.state[self.key]):
            self.state[self.key].load_state_dict(state_dict)
        else:
            self.state[self.key] = state_dict


def _split(engine: ShardingEngine | None, state: dict[str, Any], verb: str) -> tuple[str, Optimizers, dict]:
    """(the model's key, the optimizers with their keys and group names, the other entries) of `state`."""
    if not isinstance(state, dict):
        raise TypeError(
            f"strategy.{verb}(path, state): state must be a dict such as {{'model': model, "
            f"'optimizer': optimizer, 'step': 7}}, got {type(state).__name__}"
        )
    if engine is None:
        raise RuntimeError(f"strategy.{verb}: call strategy.setup_module(model) first (on every rank)")
    module = engine.module
    models = [key for key, value in state.items() if isinstance(value, nn.Module)]
    for key in models:
        if state[key] is not module:
            raise ValueError(
                f"strategy.{verb}: state[{key!r}] is a module this strategy did not set up; it "
                f"{verb}s the model given to setup_module (put other modules' state_dict() in state)"
            )
    if len(models) != 1:
        raise ValueError(
            f"strategy.{verb}: state must hold the model given to setup_module once, under a key of "
            f"your choice (such as 'model'); it holds it under {models}"
        )
    if META in state:
        raise ValueError(f"strategy.{verb}: the key {META!r} is the checkpoint's own description; use another key")
    optimizers = [
        (key, value, group_names(module, engine.optimizer_groups(value)))
        for key, value in state.items()
        if isinstance(value, torch.optim.Optimizer)
    ]
    taken = {models[0], *(key for key, _, _ in optimizers)}
    return models[0], optimizers, {key: value for key, value in state.items() if key not in taken}


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _top_level_objects(loading: checkpointer.Loading) -> list[str]:
    """The checkpoint's objects stored whole under a top-level key (not the model, an optimizer or meta)."""
    source = loading.source
    listed = loading.meta.get("objects")
    if listed is not None:
        return list(listed)
    return [key for key, path in source.paths.items() if len(path) == 1 and key not in source.tensors and key != META]


def _check_keys(loading: checkpointer.Loading, path: Any, keys: list[str]) -> None:
    stored = loading.stored_keys()
    missing = [key for key in keys if key not in stored]
    if missing:
        raise ValueError(
            f"strategy.load: checkpoint {os.fspath(path)!r} holds no {missing}; it holds {sorted(stored - {META})}"
        )
