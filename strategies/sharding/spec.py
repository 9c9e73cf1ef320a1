"""A strategy is data: which of the three model states are sharded across the data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingSpec:
    """What the engine shards. Each level implies the one before it (ZeRO stages 1, 2, 3)."""

    shard_optimizer_state: bool = False
    shard_gradients: bool = False
    shard_parameters: bool = False

    def __post_init__(self) -> None:
        if self.shard_parameters and not self.shard_gradients:
            raise ValueError("ShardingSpec: shard_parameters=True needs shard_gradients=True")
        if self.shard_gradients and not self.shard_optimizer_state:
            raise ValueError("ShardingSpec: shard_gradients=True needs shard_optimizer_state=True")


REPLICATED = ShardingSpec()
ZERO1 = ShardingSpec(shard_optimizer_state=True)
ZERO2 = ShardingSpec(shard_optimizer_state=True, shard_gradients=True)
FULL_SHARD = ShardingSpec(shard_optimizer_state=True, shard_gradients=True, shard_parameters=True)


@dataclass(frozen=True)
class UnitOptions:
    """How a unit stores and communicates its parameters (fsdp only; None keeps the parameters' dtype)."""

    param_dtype: object = None  # dtype of the gathered parameters used for compute
    reduce_dtype: object = None  # dtype gradients are reduced in
    offload_to_cpu: bool = False  # master shards, gradients and optimizer state in CPU memory
