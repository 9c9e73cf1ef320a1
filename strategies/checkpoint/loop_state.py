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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import model_state
from .format import META
from .model_state import read_meta_item
from .planners import Pickled
from .source import Source, open_source
from .writer import CheckpointWriter

if TYPE_CHECKING:
    from ..base import Strategy


def save(strategy: Strategy, path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write `state` as a checkpoint at `path`. Collective: every rank calls it with its own objects."""
    model_key, optimizers, objects = _split(strategy, state, "save")
    pieces = model_state.pieces(strategy, model_key, optimizers)
    if strategy.is_global_zero:
        pieces.update({key: Pickled(_stored(value), key) for key, value in objects.items()})
        described = model_state.describe(strategy, strategy.engine.module, optimizers)
        described["optimizers"] = [{**d, "key": key} for d, (key, _, _) in zip(described["optimizers"], optimizers)]
        pieces[META] = Pickled({**described, "model_key": model_key, "objects": sorted(objects)}, META)
    step = state.get("step")
    summary = {"world_size": strategy.world_size, "global_step": step if isinstance(step, int) else -1}
    CheckpointWriter().save(pieces, path, summary)


def load(strategy: Strategy, path: str | os.PathLike, state: dict[str, Any],
         trust_pickled: bool = False) -> dict[str, Any]:
    """Restore `state` in place from the checkpoint at `path` (of `save` or of the Trainer), resharded to this
    strategy and world size: the model and optimizers in place, objects with `load_state_dict` through it, other
    entries replaced in `state`. Returns every entry of the checkpoint that is not the model or an optimizer.
    Objects are unpickled under the allow-list unless `trust_pickled`. Collective."""
    model_key, optimizers, objects = _split(strategy, state, "load")
    source = open_source(path, trust_pickled)
    meta = read_meta_item(source)
    _check_keys(source, path, [model_key, *(key for key, _, _ in optimizers), *objects])
    stored_objects = _top_level_objects(source, meta)
    read = source.read({k: None for k in model_state.object_keys(source, {key for key, _, _ in optimizers})})
    read.update(source.read({key: None for key in stored_objects}))
    saved = [model_state.saved_optimizer(source, read, meta, key) for key, _, _ in optimizers]
    compared = [(optimizer, names, ckpt) for (_, optimizer, names), ckpt in zip(optimizers, saved)]
    problems = model_state.problems(strategy, source, meta, model_key, compared)
    if problems:
        raise ValueError(f"strategy.load: checkpoint {os.fspath(path)!r} does not fit this model:\n  "
                         + "\n  ".join(problems))
    model_state.read_into(strategy, source, model_key, [(opt, ckpt) for (_, opt, _), ckpt in zip(optimizers, saved)])
    for key, value in objects.items():
        if _is_stateful(value):
            value.load_state_dict(read[key])
        else:
            state[key] = read[key]
    return {key: read[key] for key in stored_objects}


def _split(strategy: Strategy, state: dict[str, Any], verb: str) -> tuple[str, model_state.Optimizers, dict]:
    """(the model's key, the optimizers with their keys and group names, the other entries) of `state`."""
    if not isinstance(state, dict):
        raise TypeError(f"strategy.{verb}(path, state): state must be a dict such as {{'model': model, "
                        f"'optimizer': optimizer, 'step': 7}}, got {type(state).__name__}")
    if strategy.engine is None:
        raise RuntimeError(f"strategy.{verb}: call strategy.setup_module(model) first (on every rank)")
    module = strategy.engine.module
    models = [key for key, value in state.items() if isinstance(value, nn.Module)]
    for key in models:
        if state[key] is not module:
            raise ValueError(f"strategy.{verb}: state[{key!r}] is a module this strategy did not set up; it "
                             f"{verb}s the model given to setup_module (put other modules' state_dict() in state)")
    if len(models) != 1:
        raise ValueError(f"strategy.{verb}: state must hold the model given to setup_module once, under a key of "
                         f"your choice (such as 'model'); it holds it under {models}")
    if META in state:
        raise ValueError(f"strategy.{verb}: the key {META!r} is the checkpoint's own description; use another key")
    optimizers = [(key, value, model_state.group_names(module, strategy.engine.optimizer_groups(value)))
                  for key, value in state.items() if isinstance(value, torch.optim.Optimizer)]
    taken = {models[0], *(key for key, _, _ in optimizers)}
    return models[0], optimizers, {key: value for key, value in state.items() if key not in taken}


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _stored(value: Any) -> Any:
    return value.state_dict() if _is_stateful(value) else value


def _top_level_objects(source: Source, meta: dict[str, Any]) -> list[str]:
    """The checkpoint's objects stored whole under a top-level key (not the model, an optimizer or meta)."""
    listed = meta.get("objects")
    if listed is not None:
        return list(listed)
    return [key for key, path in source.paths.items() if len(path) == 1 and key not in source.tensors and key != META]


def _check_keys(source: Source, path: Any, keys: list[str]) -> None:
    stored = {p[0] for p in source.paths.values()}
    missing = [key for key in keys if key not in stored]
    if missing:
        raise ValueError(f"strategy.load: checkpoint {os.fspath(path)!r} holds no {missing}; it holds "
                         f"{sorted(stored - {META})}")
