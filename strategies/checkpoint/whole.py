"""A checkpoint read whole in one process, with no process group: the plain model state dict
(`load_full_state_dict`), the whole nested dict a full file holds (`load_checkpoint`), the trainer state
(`load_trainer_state`). Any checkpoint this project writes, under any strategy and world size: a directory, a
full file or a consolidated file. Every entry point unpickles under the allow-list of unpickling.py unless given
`trust_pickled=True`."""

from __future__ import annotations

import os
from typing import Any

import torch

from .checkpointer import as_lists, object_keys, read_meta_item
from .format import EMA, META, MODEL, TRAINER, CheckpointError, optim_key
from .source import Source, open_source


def load_full_state_dict(
    path: str | os.PathLike, ema: bool = False, trust_pickled: bool = False
) -> dict[str, torch.Tensor]:
    """The plain model state dict from any checkpoint this project writes, in one process with no process group.

    Works for a checkpoint directory written under any strategy and world size, a full file
    (`save_checkpoint(path, full=True)`) or a consolidated file. The names and shapes are the original model's;
    tied names share their tensor. Tensors are on the CPU.

    Args:
        path: the checkpoint directory or file.
        ema: read the moving average of `callbacks.EMA` in place of each parameter it averages (the frozen
            parameters and the buffers keep their trained values).
        trust_pickled: unpickle whatever the checkpoint holds. Only for a checkpoint whose writer you trust:
            unpickling can run code. By default only tensors, plain data and the project's state types are read.

    Returns:
        The state dict, in the model's `state_dict()` order, for `model.load_state_dict`.

    Raises:
        FileNotFoundError: if `path` is neither a file nor an existing directory.
        CheckpointError: if the checkpoint is incomplete, corrupted (a file fails its size or checksum check),
            of another format version, or a file that holds neither a state dict nor a full checkpoint; without
            `trust_pickled`, if what it reads holds pickled objects of other types (named, with where).
        ValueError: with `ema=True`, if the checkpoint holds no EMA weights.

    Example:
        ```python
        model.load_state_dict(load_full_state_dict("runs/version_0/checkpoints/last"))
        ```
    """
    source = open_source(path, trust_pickled)
    meta = read_meta_item(source)
    keys = weight_keys(source, meta, path, ema)
    values = source.read({k: _empty(source.tensors[k]) if k in source.tensors else None for k in set(keys.values())})
    entries = {key: values[read] for key, read in keys.items()}
    return assemble(source, {**entries, META: meta} if META in source.paths else entries)[MODEL]


def weight_keys(source: Source, meta: dict[str, Any], path: Any, ema: bool = False) -> dict[str, str]:
    """The key of each model entry ("model.<name>", tied aliases left out) and the key it is read from: itself,
    or with `ema` the average ("ema.<name>") where the checkpoint has one."""
    tied = tied_keys(meta)
    keys = {k: k for k, p in source.paths.items() if p[0] == MODEL and k not in tied}
    if not ema:
        return keys
    averaged = {p[1]: k for k, p in source.paths.items() if p[0] == EMA and len(p) == 2}
    if not averaged:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds no EMA weights: it was written without "
            "callbacks.EMA, or before the average's first update; leave out ema=True (--ema)"
        )
    return {k: averaged.get(source.paths[k][1], k) for k in keys}


def load_checkpoint(path: str | os.PathLike, weights_only: bool = False, trust_pickled: bool = False) -> dict[str, Any]:
    """A whole checkpoint in one process, as the nested dict a full file holds. Every item is checked as it is
    read.

    Args:
        path: the checkpoint directory or file.
        weights_only: read only `"model"` and `"meta"`.
        trust_pickled: unpickle whatever the checkpoint holds (only for a checkpoint whose writer you trust).

    Returns:
        A dict with what the checkpoint has of `"model"` (the state dict, tied names too), `"optim"` (and
        `"optim_1"`, ... for further optimizers), `"trainer"`, `"rng"` and `"meta"`; callbacks' sharded state
        (e.g. `"ema"`) too.

    Raises:
        FileNotFoundError: if `path` is neither a file nor an existing directory.
        CheckpointError: if the checkpoint is incomplete, corrupted (a file fails its size or checksum check),
            of another format version, or a file that holds neither a state dict nor a full checkpoint; without
            `trust_pickled`, if it holds pickled objects of types outside the allow-list.
    """
    source = open_source(path, trust_pickled)
    meta = read_meta_item(source)
    tied = tied_keys(meta)  # a full file holds them: tied again below
    wanted = [k for k, p in source.paths.items() if k != META and k not in tied and (p[0] == MODEL or not weights_only)]
    values = source.read({k: _empty(source.tensors[k]) if k in source.tensors else None for k in wanted})
    return assemble(source, {**values, META: meta} if META in source.paths else values)


def tied_keys(meta: dict[str, Any]) -> set[str]:
    """The keys of the tied names of parameters ("model.<alias>"), which a checkpoint stores under the first name."""
    return {f"{MODEL}.{alias}" for alias in meta.get("aliases", {})}


def load_trainer_state(path: str | os.PathLike, trust_pickled: bool = False) -> dict[str, Any]:
    """The trainer state of a checkpoint (epoch, step, schedulers, callbacks' state, hyperparameters, ...), in
    one process.

    Args:
        path: the checkpoint directory or full file.
        trust_pickled: unpickle whatever the checkpoint holds (only for a checkpoint whose writer you trust).

    Returns:
        The trainer state dict rank 0 saved.

    Raises:
        FileNotFoundError: if `path` is neither a file nor an existing directory.
        CheckpointError: if the checkpoint is incomplete, corrupted (a file fails its size or checksum check),
            of another format version, or a file that holds neither a state dict nor a full checkpoint.
            Also if it holds weights only (a plain state dict), with no trainer state to read; without
            `trust_pickled`, if it holds pickled objects of types outside the allow-list.
    """
    source = open_source(path, trust_pickled)
    if not object_keys(source, {TRAINER}):
        raise CheckpointError(
            f"{os.fspath(path)!r} holds weights only: there is no trainer state to read (a "
            "checkpoint directory or trainer.save_checkpoint(path, full=True) has one)"
        )
    return source.read({TRAINER: None})[TRAINER]


def _empty(meta_tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(meta_tensor.shape, dtype=meta_tensor.dtype)


def assemble(source: Source, values: dict[str, Any]) -> dict[str, Any]:
    """The nested dict of a checkpoint from `values` by DCP key: lists where DCP split a list, the model in
    state-dict order with the tied names added, each parameter's optimizer state in that order too."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        node = nested
        for part in source.paths[key][:-1]:
            node = node.setdefault(part, {})
        node[source.paths[key][-1]] = value
    nested = as_lists(nested)
    meta = nested.get(META, {})
    order = {name: i for i, name in enumerate(meta.get("state_dict_keys", []))}

    def in_order(names: Any) -> list[str]:
        return sorted(names, key=lambda name: order.get(name, len(order)))

    model = nested.get(MODEL, {})
    for alias, first in meta.get("aliases", {}).items():
        if first in model:
            model.setdefault(alias, model[first])
    nested[MODEL] = {name: model[name] for name in in_order(model)}
    for top, value in nested.items():
        if top.startswith(optim_key(0)) and isinstance(value.get("state"), dict):
            state = value["state"]
            value["state"] = {name: dict(sorted(state[name].items())) for name in in_order(state)}
    return nested
