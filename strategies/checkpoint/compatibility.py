"""Whether a checkpoint fits a model: the description a checkpoint carries of its model and optimizers (`meta`),
and every difference between what it holds and the model loading into it (missing or unexpected parameters,
shapes, dtypes, optimizer classes and parameter groups), listed at once before anything is loaded.

The keys are the model's (`<model key>.<name>`) and each optimizer's (`<optimizer key>.state.<name>.<key>`,
`.param_groups.<i>.<key>`), as torch's `get_state_dict` keys them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..sharding.state_dict import ModelShards
from .format import FORMAT_VERSION, optim_key

Optimizers = list[tuple[str, torch.optim.Optimizer, list[list[str]]]]  # (top-level key, optimizer, group names)


def group_names(module: nn.Module, params: list[list[nn.Parameter]]) -> list[list[str]]:
    """The names (first names, as named_parameters gives them) of the module's parameters in each group."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [[name_of[id(p)] for p in group if id(p) in name_of] for group in params]


def describe(model: ModelShards, optimizers: Optimizers, world_size: int, strategy: str) -> dict[str, Any]:
    """What loading checks a model against: the parameters' aliases, the state-dict keys, the optimizers."""
    return {
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "strategy": strategy,
        "aliases": model.aliases(),
        "state_dict_keys": list(model.module.state_dict(keep_vars=True)),
        "trainable": [name for name, p in model.module.named_parameters() if p.requires_grad],
        "optimizers": [{"class": type(optimizer).__name__} for _, optimizer, _ in optimizers],
    }


def saved_class(meta: dict[str, Any], key: str) -> str | None:
    """The class of the optimizer stored under `key` (the Trainer's optimizer i is under optim_key(i))."""
    described = meta.get("optimizers", [])
    return next((d["class"] for i, d in enumerate(described) if d.get("key", optim_key(i)) == key), None)


def problems(
    model: ModelShards,
    saved_model: dict[str, Any],
    meta: dict[str, Any],
    optimizers: list[tuple[torch.optim.Optimizer, list[list[str]], dict, str | None]],
) -> list[str]:
    """Every difference between the checkpoint and the model (missing or unexpected parameters, shapes, dtypes)
    and its `optimizers` (each with its group names, what the checkpoint holds of it and its saved class).
    `saved_model`: what the checkpoint holds under the model's key."""
    expected = model.shapes()
    saved = {name: value for name, value in saved_model.items() if isinstance(value, torch.Tensor)}
    for alias, first in meta.get("aliases", {}).items():
        saved.setdefault(alias, saved.get(first))
    missing, unexpected = set(expected) - set(saved), set(saved) - set(expected)
    found = [f"missing: {key}" for key in sorted(missing)]
    found += [f"unexpected: {key}" for key in sorted(unexpected)]
    for key in sorted(set(expected) & set(saved)):
        shape, dtype = expected[key]
        if list(saved[key].shape) != list(shape):
            found.append(f"shape of {key}: checkpoint {list(saved[key].shape)}, model {list(shape)}")
            found[-1] += _piece_of(list(saved[key].shape), list(shape))
        elif saved[key].dtype != dtype:
            found.append(f"dtype of {key}: checkpoint {saved[key].dtype}, model {dtype}")
    for i, (optimizer, names, ckpt, kind) in enumerate(optimizers):
        found += _optimizer_problems(i, optimizer, names, ckpt, kind, missing | unexpected)
    return found


def _piece_of(saved: list[int], whole: list[int]) -> str:
    """A hint when the checkpoint's tensor is an even piece of the model's along one dimension: one tensor-parallel
    rank's local tensor, saved as it was."""
    differ = [d for d, (a, b) in enumerate(zip(saved, whole)) if a != b]
    if len(saved) != len(whole) or len(differ) != 1 or not saved[differ[0]]:
        return ""
    d = differ[0]
    ranks, rest = divmod(whole[d], saved[d])
    if rest or ranks < 2:
        return ""
    return (
        f" (1/{ranks} of it along dimension {d}: one tensor-parallel rank's piece, saved from its local tensor; "
        "save whole tensors with trainer.save_checkpoint or strategy.save, or gather the pieces, "
        "DTensor.full_tensor())"
    )


def _optimizer_problems(
    i: int,
    optimizer: torch.optim.Optimizer,
    names: list[list[str]],
    saved: dict,
    saved_kind: str | None,
    reported: set[str],
) -> list[str]:
    """Differences in class, group count and the parameters of each group (names already reported as missing or
    unexpected in the model are not repeated)."""
    found = []
    kind = type(optimizer).__name__
    if saved_kind != kind:
        found.append(f"class of optimizer {i}: checkpoint {saved_kind}, module {kind}")
    groups = saved.get("param_groups", [])
    if isinstance(groups, dict):
        groups = [groups[j] for j in sorted(groups, key=int)]
    if len(groups) != len(names):
        return [*found, f"parameter groups of optimizer {i}: checkpoint {len(groups)}, module {len(names)}"]
    for j, (group, group_names_) in enumerate(zip(groups, names)):
        ours, theirs = set(group_names_) - reported, set(group.get("params", [])) - reported
        found += [f"missing in optimizer {i} group {j}: {n}" for n in sorted(ours - theirs)]
        found += [f"unexpected in optimizer {i} group {j}: {n}" for n in sorted(theirs - ours)]
    return found
