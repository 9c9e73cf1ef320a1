"""ZeRO stage 1 (optimizer state sharded) and stage 2 (gradients sharded too)."""

from __future__ import annotations

from typing import Any

from .base import Strategy
from .options import MixedPrecision, check_hybrid_shard, check_mixed_precision, shard_group_size
from .sharding import ZERO1, ZERO2, UnitOptions


class ZeroStrategy(Strategy):
    """ZeRO stage 1 (optimizer state sharded) or stage 2 (gradients sharded too); parameters stay replicated.

    `Trainer(strategy="zero1")` and `"zero2"` are `ZeroStrategy(stage=1)` and `ZeroStrategy(stage=2)`.

    Args:
        stage: `1` (optimizer state sharded over the ranks) or `2` (gradients sharded too). For stage 3, use
            `FSDPStrategy`.
        mixed_precision: a `MixedPrecision`: the replicated parameters and gradients in its `param_dtype`, the
            full-precision master weights and optimizer state sharded, as in the ZeRO paper (stage 1 reduces
            gradients in `param_dtype`). `None` for no mixed precision.
        hybrid_shard: `None` (shard over every rank), `"node"` (shard within each machine's ranks, replicate
            across machines) or a group size G (shard within groups of G ranks, replicate across the groups).
            As ZeRO++'s hpZ.
        compile: which modules' `forward` to `torch.compile` in place, the engine's hooks staying outside:
            `None` or `False` (none), `True` (the model itself if it defines `forward`, else each child of it that
            holds parameters), a set of module classes, or a callable `(module, name) -> bool`.
        compile_options: keyword arguments for `torch.compile` (e.g. `{"mode": "max-autotune"}`).
        tensor_parallel_size: the ranks that split each layer with torch's tensor parallel, which the module
            applies in `configure_model` on `self.device_mesh["tensor_parallel"]` (1: none; "auto": the GPUs of
            one node). The strategy then shards the local pieces over the data-parallel ranks.
        elementwise_optimizers: optimizer classes declared element-wise, stepped on this rank's flat pieces (see
            `Strategy`; torch's are known and other classes are checked, so this is rarely needed).
        context_parallel_size: the ranks that split each sequence (see `Strategy`); the model state is sharded
            over them too.
        context_parallel_method: `"ulysses"` (see `Strategy`).

    Raises:
        ValueError: if `stage` is not 1 or 2, or `hybrid_shard` is not one of the forms above.
        TypeError: if `mixed_precision` is not a `MixedPrecision` or None; for a `compile` or `compile_options`
            of the wrong type.
    """

    def __init__(
        self,
        stage: int = 1,
        mixed_precision: MixedPrecision | None = None,
        hybrid_shard: int | str | None = None,
        compile: Any = None,
        compile_options: dict[str, Any] | None = None,
        tensor_parallel_size: int | str = 1,
        elementwise_optimizers: Any = (),
        context_parallel_size: int = 1,
        context_parallel_method: str = "ulysses",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_split: list[list[str]] | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroStrategy: stage={stage!r}; choose 1 or 2 (use FSDPStrategy for stage 3)")
        super().__init__(
            compile,
            compile_options,
            tensor_parallel_size,
            elementwise_optimizers,
            context_parallel_size,
            context_parallel_method,
            pipeline_parallel_size,
            pipeline_schedule,
            pipeline_microbatches,
            pipeline_split,
        )
        self.stage = stage
        self.spec = ZERO1 if stage == 1 else ZERO2
        self.name = f"zero{stage}"
        self.mixed_precision = check_mixed_precision("ZeroStrategy", mixed_precision)
        self.hybrid_shard = check_hybrid_shard("ZeroStrategy", hybrid_shard)

    def engine_options(self) -> dict[str, Any]:
        options = UnitOptions(self.mixed_precision.param_dtype, self.mixed_precision.reduce_dtype)
        return {
            "unit_options": options,
            "shard_group_size": shard_group_size(self.hybrid_shard, self.data_parallel_size),
        }

    def __repr__(self) -> str:
        return f"ZeroStrategy(stage={self.stage}, mixed_precision={self.mixed_precision})"
