"""Cutting a model into pipeline stages by module name (torchtitan's `module_fqns_per_model_part`).

A split is a list of stages, each a list of module names of the model. By default the model's repeated blocks (its
largest list of modules of one class, such as a Llama's `layers`) are cut evenly, the modules before them going to
the first stage and those after to the last. A stage keeps the model's own module and parameter names: the modules
it does not hold become None (torchtitan's convention; the model's forward skips them), and a list of blocks keeps
the indices of the blocks it holds (`layers.2` stays `layers.2`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from torch import nn


class HeldBlocks(nn.ModuleDict):
    """What a stage keeps of a list of blocks: the blocks it holds under their indices, so names stay the model's.
    It iterates and indexes as the list did (`for layer in self.layers`, `len(self.layers)`)."""

    def __iter__(self) -> Iterator[nn.Module]:  # the blocks, not their keys: as the ModuleList iterated
        return iter(self.values())

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))

    def forward(self, x: object) -> object:  # as an nn.Sequential of blocks runs them
        for block in self:
            x = block(x)
        return x


def repeated_blocks(module: nn.Module) -> str:
    """The name of the model's repeated blocks: its largest ModuleList or Sequential whose children share one
    class (by their count of parameters)."""
    best, best_size = None, 0
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        size = sum(p.numel() for p in child.parameters())
        if size > best_size:
            best, best_size = name, size
    if best is None:
        raise ValueError(
            "pipeline_split=None: the model has no list of repeated blocks (a ModuleList of one class) to cut "
            "evenly; give pipeline_split, a list of module names per stage"
        )
    return best


def default_split(module: nn.Module, stages: int) -> list[list[str]]:
    """The repeated blocks cut evenly into `stages` (the first stages take one more when they do not divide), the
    modules before them on the first stage and those after on the last."""
    blocks_name = repeated_blocks(module)
    blocks = [f"{blocks_name}.{i}" for i in range(len(module.get_submodule(blocks_name)))]
    if len(blocks) < stages:
        raise ValueError(
            f"pipeline_parallel_size: {stages} stages for the {len(blocks)} blocks of {blocks_name!r}; choose at "
            f"most {len(blocks)} stages, or give pipeline_split"
        )
    before, after = _around(module, blocks_name)
    per_stage, extra = divmod(len(blocks), stages)
    split, start = [], 0
    for stage in range(stages):
        end = start + per_stage + (1 if stage < extra else 0)
        split.append(blocks[start:end])
        start = end
    split[0] = before + split[0]
    split[-1] = split[-1] + after
    return split


def _around(module: nn.Module, blocks_name: str) -> tuple[list[str], list[str]]:
    """The modules (with parameters or buffers) registered before and after the blocks, on the path to them."""
    before: list[str] = []
    after: list[str] = []
    parts = blocks_name.split(".")
    current, prefix = module, ""
    for part in parts:
        seen = False
        for name, child in current.named_children():
            full = prefix + name
            if name == part:
                seen = True
                continue
            if child is not None and _holds_state(child):
                (after if seen else before).append(full)
        current, prefix = current.get_submodule(part), prefix + part + "."
    return before, after


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def check_split(module: nn.Module, split: object) -> list[list[str]]:
    """`pipeline_split` as given, checked: a list of stages, each a list of module names of `module`, that
    together hold every parameter once."""
    if not isinstance(split, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in split) or not split:
        raise TypeError(f"pipeline_split: expected a list of stages, each a list of module names, got {split!r}")
    modules = dict(module.named_modules())
    owner: dict[str, int] = {}
    for stage, names in enumerate(split):
        if not names:
            raise ValueError(f"pipeline_split: stage {stage} holds no module")
        for name in names:
            if name not in modules or name == "":
                close = sorted(n for n in modules if n and n.split(".")[-1] == str(name).split(".")[-1])[:5]
                hint = f"; did you mean one of {close}" if close else ""
                raise ValueError(
                    f"pipeline_split: stage {stage} names {name!r}, which is not a module of the model{hint}"
                )
            for param_name, _ in modules[name].named_parameters(prefix=name, remove_duplicate=False):
                if param_name in owner and owner[param_name] != stage:
                    raise ValueError(
                        f"pipeline_split: parameter {param_name!r} is in stage {owner[param_name]} and stage {stage}; "
                        "each parameter goes to one stage (tied weights across stages must be untied)"
                    )
                owner[param_name] = stage
    left_out = [name for name, _ in module.named_parameters(remove_duplicate=False) if name not in owner]
    if left_out:
        raise ValueError(f"pipeline_split: no stage holds {_modules_of(left_out)}; name each module in one stage")
    _check_no_tied(module, owner)
    return [list(names) for names in split]


def _modules_of(param_names: list[str]) -> list[str]:
    return sorted({name.rsplit(".", 1)[0] if "." in name else name for name in param_names})[:8]


def _check_no_tied(module: nn.Module, owner: dict[str, int]) -> None:
    """One parameter object under two names in two stages (a head tied to the embedding) cannot be split."""
    stage_of: dict[int, tuple[str, int]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in stage_of and stage_of[id(p)][1] != owner[name]:
            first, stage = stage_of[id(p)]
            raise ValueError(
                f"pipeline_split: {first!r} (stage {stage}) and {name!r} (stage {owner[name]}) are one tied "
                "parameter; untie them (give each stage its own) or put both modules in one stage"
            )
        stage_of.setdefault(id(p), (name, owner[name]))


def keep_only(module: nn.Module, names: list[str]) -> None:
    """Make `module` hold only the modules `names` (and what contains them), in place: the others become None,
    a list of blocks a HeldBlocks of those it keeps."""
    _prune(module, set(names), "", in_place=True)


def stage_view(module: nn.Module, names: list[str]) -> nn.Module:
    """A view of `module` that holds only `names`: copies of the modules on the way to them, sharing every module
    and parameter it keeps with `module` (a rank with two stages calls each stage's view)."""
    return _prune(module, set(names), "", in_place=False)


def _prune(module: nn.Module, keep: set[str], prefix: str, in_place: bool) -> nn.Module:
    out = module if in_place else copy.copy(module)
    if not in_place:
        out._modules = dict(module._modules)
    for name, child in list(module._modules.items()):
        full = prefix + name
        if child is None or not _holds_state(child):
            continue  # a module without state (dropout, an activation) costs nothing: every stage keeps it
        if any(full == k or full.startswith(k + ".") for k in keep):
            continue  # held whole
        if any(k.startswith(full + ".") for k in keep):
            out._modules[name] = _prune(child, keep, full + ".", in_place)
        else:
            out._modules[name] = None
    if isinstance(module, (nn.ModuleList, nn.Sequential, HeldBlocks)):
        held = HeldBlocks({k: m for k, m in out._modules.items() if m is not None})
        return held
    return out
