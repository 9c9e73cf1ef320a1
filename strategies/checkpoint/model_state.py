"""The model and its optimizers in a checkpoint, by parameter name, under any strategy: what each rank writes of
them (its own pieces, nothing gathered), the description loading checks a model against, and reading them back
into another strategy and world size (each rank reading only the chunks that overlap its own pieces).

The Trainer's checkpoints and a plain loop's `strategy.save` share this part; the keys are the model's
(`<model key>.<name>`) and each optimizer's (`<optimizer key>.state.<name>.<key>`, `.param_groups.<i>.<key>`), as
torch's `get_state_dict` keys them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..sharding import FlatPieces
from .errors import read_on_every_rank
from .format import FORMAT_VERSION, META, optim_key
from .source import Source

if TYPE_CHECKING:
    from ..base import Strategy

Optimizers = list[tuple[str, torch.optim.Optimizer, list[list[str]]]]  # (top-level key, optimizer, group names)


def group_names(module: nn.Module, params: list[list[nn.Parameter]]) -> list[list[str]]:
    """The names (first names, as named_parameters gives them) of the module's parameters in each group."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [[name_of[id(p)] for p in group if id(p) in name_of] for group in params]


def pieces(strategy: Strategy, model_key: str, optimizers: Optimizers) -> dict[str, Any]:
    """This rank's part of the model and optimizer state: its pieces (the parameter groups from rank 0 only)."""
    state: dict[str, Any] = {model_key: strategy.model_state_pieces()}
    for key, optimizer, names in optimizers:
        state[key] = strategy.optimizer_state_pieces(optimizer, names)
        if not strategy.is_global_zero:
            del state[key]["param_groups"]  # the same on every rank: written once
    return state


def describe(strategy: Strategy, module: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    """What loading checks a model against: the parameters' aliases, the state-dict keys, the optimizers."""
    return {
        "format_version": FORMAT_VERSION,
        "world_size": strategy.world_size,
        "strategy": repr(strategy),
        "aliases": strategy.parameter_aliases(),
        "state_dict_keys": list(module.state_dict(keep_vars=True)),
        "trainable": [name for name, p in module.named_parameters() if p.requires_grad],
        "optimizers": [{"class": type(optimizer).__name__} for _, optimizer, _ in optimizers],
    }


def read_meta_item(source: Source) -> dict[str, Any]:
    """The checkpoint's "meta" ({} for a plain state dict)."""
    return source.read({META: None})[META] if META in source.paths else {}


def saved_optimizer(source: Source, objects: dict[str, Any], meta: dict[str, Any], key: str) -> dict:
    """The optimizer stored under `key` as saved: "state" (name -> key -> meta tensor or value), "keys" ((name,
    key) -> DCP key), "param_groups" (list of dicts) and "class". `objects` holds its non-tensor items."""
    state: dict[str, dict[str, Any]] = {}
    keys, groups = {}, {}
    for item, path in source.paths.items():
        if path[0] != key:
            continue
        value = source.tensors.get(item, objects.get(item))
        if path[1] == "state":
            state.setdefault(path[2], {})[path[3]] = value
            keys[path[2], path[3]] = item
        elif path[1] == "param_groups":
            groups.setdefault(int(path[2]), {})[path[3]] = value
    described = meta.get("optimizers", [])  # the Trainer's optimizer i is under optim_key(i)
    kind = next((d["class"] for i, d in enumerate(described) if d.get("key", optim_key(i)) == key), None)
    return {"state": state, "keys": keys, "param_groups": [groups[j] for j in sorted(groups)], "class": kind}


def object_keys(source: Source, tops: set[str]) -> list[str]:
    """The items under the top-level keys `tops` that are objects, not tensors (read whole by every rank)."""
    return [k for k, p in source.paths.items() if k not in source.tensors and (k in tops or p[0] in tops)]


def problems(strategy: Strategy, source: Source, meta: dict, model_key: str,
             optimizers: list[tuple[torch.optim.Optimizer, list[list[str]], dict]]) -> list[str]:
    """Every difference between the checkpoint and the model (missing or unexpected parameters, shapes, dtypes)
    and its `optimizers` (each with its group names and what saved_optimizer read)."""
    expected = strategy.full_state_shapes()
    saved = {p[1]: source.tensors[k] for k, p in source.paths.items() if p[0] == model_key and k in source.tensors}
    for alias, first in meta.get("aliases", {}).items():
        saved.setdefault(alias, saved.get(first))
    missing, unexpected = set(expected) - set(saved), set(saved) - set(expected)
    found = [f"missing: {key}" for key in sorted(missing)]
    found += [f"unexpected: {key}" for key in sorted(unexpected)]
    for key in sorted(set(expected) & set(saved)):
        shape, dtype = expected[key]
        if list(saved[key].shape) != list(shape):
            found.append(f"shape of {key}: checkpoint {list(saved[key].shape)}, model {list(shape)}")
        elif saved[key].dtype != dtype:
            found.append(f"dtype of {key}: checkpoint {saved[key].dtype}, model {dtype}")
    for i, (optimizer, names, ckpt) in enumerate(optimizers):
        found += _optimizer_problems(i, optimizer, names, ckpt, missing | unexpected)
    return found


def _optimizer_problems(i: int, optimizer: torch.optim.Optimizer, names: list[list[str]], saved: dict,
                        reported: set[str]) -> list[str]:
    """Differences in class, group count and the parameters of each group (names already reported as missing or
    unexpected in the model are not repeated)."""
    found = []
    kind = type(optimizer).__name__
    if saved["class"] != kind:
        found.append(f"class of optimizer {i}: checkpoint {saved['class']}, module {kind}")
    groups = saved["param_groups"]
    if len(groups) != len(names):
        return [*found, f"parameter groups of optimizer {i}: checkpoint {len(groups)}, module {len(names)}"]
    for j, (group, group_names_) in enumerate(zip(groups, names)):
        ours, theirs = set(group_names_) - reported, set(group.get("params", [])) - reported
        found += [f"missing in optimizer {i} group {j}: {n}" for n in sorted(ours - theirs)]
        found += [f"unexpected in optimizer {i} group {j}: {n}" for n in sorted(theirs - ours)]
    return found


def read_into(strategy: Strategy, source: Source, model_key: str,
              optimizers: list[tuple[torch.optim.Optimizer, dict]], more: dict[str, Any] | None = None) -> None:
    """Load the model, the optimizers' state (each with what saved_optimizer read) and the `more` targets (by
    checkpoint key) in place, each rank reading only the chunks of its own pieces; then every copy of the
    parameters is brought up to date and the saved hyperparameters are put in each parameter group."""
    plain: dict[str, Any] = {}
    shards: dict[str, FlatPieces] = {}

    def place(key: str, target: Any) -> None:
        (shards if isinstance(target, FlatPieces) else plain)[key] = target

    for name, target in strategy.model_state_targets().items():
        place(f"{model_key}.{name}", target)
    for optimizer, saved in optimizers:
        for name, entries in strategy.optimizer_state_targets(optimizer, saved["state"]).items():
            for key, target in entries.items():
                place(saved["keys"][name, key], target)
    for key, target in (more or {}).items():
        place(key, target)
    read_on_every_rank(strategy, lambda: source.read(plain, shards))
    strategy.state_loaded()
    for optimizer, saved in optimizers:
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k not in ("params", "param_names")})
