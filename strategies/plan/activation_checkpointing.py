"""Activation checkpointing as the plan runs it in its fake passes: torch.utils.checkpoint around each module the
policy picks, fully (everything recomputed in backward, as the engine does) or selectively, with torchtitan's
per-op policy: matmul outputs saved every other one, attention outputs saved, everything else recomputed."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("full", "selective")
_aten = torch.ops.aten
ATTENTION_FORWARD = {
    op
    for op in (
        getattr(_aten, name, None)
        for name in (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        )
    )
    if op is not None
}
SAVED_BY_SELECTIVE = {_aten.mm, _aten.addmm, *ATTENTION_FORWARD}


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """One checkpointed call's policy (make a fresh one per call: `selective_context`). The forward and the
    recompute count their matmuls apart, so both pick the same ones (one counter would flip the parity in the
    recompute whenever a forward has an odd number of matmuls, and hand the recompute the wrong saved outputs)."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func._overloadpacket in (_aten.mm, _aten.addmm):
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:  # every second matmul is recomputed, as in torchtitan
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func._overloadpacket in SAVED_BY_SELECTIVE:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context() -> Any:
    """A `context_fn` for torch.utils.checkpoint: torchtitan's selective policy, fresh for each call."""
    return create_selective_checkpoint_contexts(selective_policy())


def checkpoint_modules(model: nn.Module, checkpointed: Callable[[nn.Module, str], bool] | None, mode: str) -> None:
    """Wrap the forward of each module the policy picks in torch.utils.checkpoint (not nested)."""
    if checkpointed is None:
        return
    picked: list[str] = []
    for name, module in model.named_modules():
        if not name or not checkpointed(module, name) or any(name.startswith(p + ".") for p in picked):
            continue
        picked.append(name)
        context = selective_context if mode == "selective" else None
        extra = {"context_fn": context} if context is not None else {}
        if context is not None and "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
            extra["respect_saved_tensors_hooks"] = False  # SAC's saved outputs are counted as alive, not saved
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **extra)
