"""Options that several strategies share: mixed precision and hybrid sharding."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision for `FSDPStrategy` and `ZeroStrategy`: compute in one dtype, keep fp32 master weights.

    Parameters are gathered (or kept replicated) in `param_dtype` for compute; master weights and optimizer state
    stay in the parameters' own dtype (fp32).

    Args:
        param_dtype: the dtype of the parameters used for compute, e.g. `torch.bfloat16`; `None` for the
            parameters' own dtype.
        reduce_dtype: the dtype in which gradients are reduced over the ranks; `None` for `param_dtype`.

    Raises:
        TypeError: if either is not a floating `torch.dtype` or None.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision: {name} must be a floating torch.dtype or None, got {value!r}")


def check_mixed_precision(owner: str, value: MixedPrecision | None) -> MixedPrecision:
    """`value`, or no mixed precision for None."""
    if value is not None and not isinstance(value, MixedPrecision):
        raise TypeError(f"{owner}: mixed_precision must be a MixedPrecision or None, got {value!r}")
    return value or MixedPrecision()


def check_hybrid_shard(owner: str, value: int | str | None) -> int | str | None:
    """None (shard over every rank), "node" (over the ranks of one machine) or a group size G."""
    if value is None or value == "node" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(
        f'{owner}: hybrid_shard={value!r}; use None, "node" (the ranks of one machine) or a '
        "positive int, the number of ranks that shard among themselves"
    )


def shard_group_size(hybrid_shard: int | str | None, world_size: int) -> int | None:
    """The engine's shard group size for `hybrid_shard` (torchrun's LOCAL_WORLD_SIZE for "node")."""
    if hybrid_shard == "node":
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return hybrid_shard
