"""Activation checkpointing: chosen modules recompute their activations in backward instead of storing them."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from .sharding import WrapPolicy


def apply_activation_checkpointing(root: nn.Module, policy: WrapPolicy) -> list[str]:
    """Wrap the forward of every module the policy selects with torch's non-reentrant checkpoint."""
    chosen = [(name, m) for name, m in root.named_modules() if name and policy(m, name)]
    for _, module in chosen:
        original = module.forward

        def forward(*args: Any, _original=original, **kwargs: Any) -> Any:
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        module.forward = forward
    return [name for name, _ in chosen]
