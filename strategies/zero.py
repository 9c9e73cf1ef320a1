"""ZeRO stage 1 (optimizer state sharded) and stage 2 (gradients sharded too)."""

from __future__ import annotations

from typing import Any

from .base import Strategy
from .options import MixedPrecision, check_hybrid_shard, check_mixed_precision, shard_group_size
from .sharding import ZERO1, ZERO2, UnitOptions


class ZeroStrategy(Strategy):
    """`mixed_precision`: replicated parameters and gradients in `param_dtype`, full-precision master weights and
    optimizer state sharded, as in the ZeRO paper (stage 1 reduces gradients in `param_dtype`).
    `hybrid_shard=G`: shard within groups of G ranks, replicate across the groups (ZeRO++'s hpZ).
    `compile`: as DDPStrategy's."""

    def __init__(
        self,
        stage: int = 1,
        mixed_precision: MixedPrecision | None = None,
        hybrid_shard: int | str | None = None,
        compile: Any = None,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroStrategy: stage={stage!r}; choose 1 or 2 (use FSDPStrategy for stage 3)")
        super().__init__(compile, compile_options)
        self.stage = stage
        self.spec = ZERO1 if stage == 1 else ZERO2
        self.name = f"zero{stage}"
        self.mixed_precision = check_mixed_precision("ZeroStrategy", mixed_precision)
        self.hybrid_shard = check_hybrid_shard("ZeroStrategy", hybrid_shard)

    def engine_options(self) -> dict[str, Any]:
        options = UnitOptions(self.mixed_precision.param_dtype, self.mixed_precision.reduce_dtype)
        return {"unit_options": options, "shard_group_size": shard_group_size(self.hybrid_shard, self.world_size)}

    def __repr__(self) -> str:
        return f"ZeroStrategy(stage={self.stage}, mixed_precision={self.mixed_precision})"
