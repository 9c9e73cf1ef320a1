"""Auto-wrap policies: which modules become fsdp units."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from .sharding import WrapPolicy


def module_class_policy(classes: set[type[nn.Module]]) -> WrapPolicy:
    """Every instance of one of `classes` becomes a unit (e.g. a transformer block)."""
    classes = tuple(classes)
    return lambda module, name: isinstance(module, classes)


def min_params_policy(min_num_params: int) -> WrapPolicy:
    """A module becomes a unit when the parameters it holds outside its own child units reach
    `min_num_params`; children are decided first, as in torch's size_based_auto_wrap_policy."""
    # Keyed by the module itself, weakly: a module made after another was freed (a planned copy, say) may reuse
    # its id, and must not inherit its size.
    unwrapped_size: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    def size_outside_units(module: nn.Module) -> int:
        if module not in unwrapped_size:
            direct = sum(p.numel() for p in module.parameters(recurse=False))
            children = sum(size_outside_units(c) for c in module.children() if not is_unit(c))
            unwrapped_size[module] = direct + children
        return unwrapped_size[module]

    def is_unit(module: nn.Module) -> bool:
        return size_outside_units(module) >= min_num_params

    return lambda module, name: is_unit(module)


def resolve_wrap_policy(policy: Any, argument: str = "auto_wrap_policy") -> WrapPolicy | None:
    """A wrap policy from its user-facing forms; `argument` names the argument in the error (activation_checkpointing
    takes the same forms)."""
    if policy is None:
        return None
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
        return module_class_policy(set(policy))
    if isinstance(policy, int) and not isinstance(policy, bool) and policy > 0:
        return min_params_policy(policy)
    if callable(policy) and not isinstance(policy, type):
        return policy
    raise TypeError(
        f"FSDPStrategy: {argument} must be None, a set of nn.Module classes (each instance "
        f"{'becomes a unit' if argument == 'auto_wrap_policy' else 'is chosen'}), "
        f"a positive int (minimum parameters per unit) or a callable (module, name) -> bool; got {policy!r}"
    )
