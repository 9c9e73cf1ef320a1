"""Fully sharded data parallel: parameters, gradients and optimizer state sharded; each unit's parameters are
all-gathered just before it computes and freed right after."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Strategy
from .sharding import FULL_SHARD
from .wrap import resolve_wrap_policy


class FSDPStrategy(Strategy):
    name = "fsdp"
    spec = FULL_SHARD

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        cpu_offload: bool = False,
        activation_checkpointing: Any = None,
        reshard_after_forward: bool = True,
        mixed_precision: Any = None,
    ) -> None:
        super().__init__()
        self.auto_wrap_policy = resolve_wrap_policy(auto_wrap_policy)
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing is not None:
            resolve_wrap_policy(activation_checkpointing)  # same forms as auto_wrap_policy; validate early
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"FSDPStrategy: reshard_after_forward must be a bool, got {reshard_after_forward!r}"
            )
        self.reshard_after_forward = reshard_after_forward
        if cpu_offload:
            raise NotImplementedError("FSDPStrategy(cpu_offload=True) is not implemented yet")
        self.cpu_offload = cpu_offload
        if mixed_precision is not None:
            raise NotImplementedError(
                "FSDPStrategy(mixed_precision=...) is not implemented yet; "
                "use Trainer(precision='bf16-mixed')"
            )
        self.mixed_precision = mixed_precision

    def model_init_context(self) -> Any:
        """configure_model builds on the meta device: no memory until each rank materializes its shards."""
        return torch.device("meta")

    def engine_options(self) -> dict[str, Any]:
        return {"wrap_policy": self.auto_wrap_policy, "reshard_after_forward": self.reshard_after_forward}

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.activation_checkpointing is not None:
            from .checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(module, resolve_wrap_policy(self.activation_checkpointing))
        return super().setup_module(module)

    def __repr__(self) -> str:
        return f"FSDPStrategy(reshard_after_forward={self.reshard_after_forward})"
