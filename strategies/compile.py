"""torch.compile per module, with the engine's hooks outside the compiled code.

Each chosen module's `forward` is replaced in place by `torch.compile(module.forward)`: parameter names and
state-dict keys do not change (no `_orig_mod.` wrapper), and the module's own hooks (where the engine gathers a
unit's parameters, casts its inputs and arms its backward) run in eager mode around the compiled forward, as
torchtitan places FSDP2's hooks around each compiled block. (`module.compile()` would compile `__call__`, hooks
included, and break the graph at the first collective.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .sharding import WrapPolicy
from .wrap import resolve_wrap_policy


def resolve_compile(owner: str, value: Any) -> bool | WrapPolicy | None:
    """None/False: nothing; True: the strategy's units (see `modules_to_compile`); else a wrap-policy form (a set of
    module classes, or a callable (module, name) -> bool) choosing the modules."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    if isinstance(value, int):
        raise TypeError(f"{owner}: compile={value!r}; use True, a set of module classes or a callable (module, name)")
    try:
        return resolve_wrap_policy(value)
    except TypeError:
        raise TypeError(
            f"{owner}: compile={value!r}; use True (the strategy's units), a set of module classes "
            "or a callable (module, name) -> bool"
        ) from None


def modules_to_compile(root: nn.Module, choice: bool | WrapPolicy, units: list[nn.Module]) -> list[nn.Module]:
    """The modules a compile choice selects. True: the given units (fsdp's wrapped modules); without any, the root
    if it defines forward, else each child of the root that holds parameters."""
    if choice is not True:
        return [m for name, m in root.named_modules() if name and choice(m, name)]
    if units:
        return units
    if type(root).forward is not nn.Module.forward:
        return [root]
    return [child for child in root.children() if any(True for _ in child.parameters())]


def compile_in_place(modules: list[nn.Module], options: dict[str, Any]) -> None:
    for module in modules:
        module.forward = torch.compile(module.forward, **options)
