"""Fully sharded data parallel: parameters, gradients and optimizer state sharded; each unit's parameters are
all-gathered just before it computes and freed right after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .base import Strategy
from .checkpointing import apply_activation_checkpointing
from .options import MixedPrecision, check_hybrid_shard, check_mixed_precision, shard_group_size
from .sharding import FULL_SHARD, UnitOptions
from .sharding.deferred_init import deferred_init
from .sharding.units import policy_modules
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
        mixed_precision: MixedPrecision | None = None,
        activation_offload: bool = False,
        hybrid_shard: int | str | None = None,
        compile: Any = None,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        """`compile`: True (every wrapped unit; the root's forward without a wrap policy), a set of module classes
        or a callable (module, name) -> bool; each chosen module's forward is torch.compile'd in place, with
        `compile_options` (torch.compile's keyword arguments), the engine's hooks outside."""
        super().__init__(compile, compile_options)
        self.auto_wrap_policy = resolve_wrap_policy(auto_wrap_policy)
        # Same forms as auto_wrap_policy: a set of classes, a minimum size or a callable.
        self.activation_checkpointing = resolve_wrap_policy(activation_checkpointing)
        for name, value in [("reshard_after_forward", reshard_after_forward), ("cpu_offload", cpu_offload),
                            ("activation_offload", activation_offload)]:
            if not isinstance(value, bool):
                raise TypeError(f"FSDPStrategy: {name} must be a bool, got {value!r}")
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload, self.activation_offload = cpu_offload, activation_offload
        self.mixed_precision = check_mixed_precision("FSDPStrategy", mixed_precision)
        self.hybrid_shard = check_hybrid_shard("FSDPStrategy", hybrid_shard)

    @contextmanager
    def model_init_context(self) -> Iterator[None]:
        """configure_model builds on the meta device, recording how each tensor is made: no memory until each rank
        materializes its shards, unit by unit, with exactly the values the eager construction makes."""
        with deferred_init() as record:
            self._init_record = record
            yield

    def engine_options(self) -> dict[str, Any]:
        options = UnitOptions(self.mixed_precision.param_dtype, self.mixed_precision.reduce_dtype, self.cpu_offload)
        return {"wrap_policy": self.auto_wrap_policy, "reshard_after_forward": self.reshard_after_forward,
                "unit_options": options, "shard_group_size": shard_group_size(self.hybrid_shard, self.world_size),
                "forward_context": self._offload_activations if self.activation_offload else None}

    def plan_options(self) -> dict[str, Any]:
        options = {"wrap_policy": self.auto_wrap_policy, "activation_checkpointing": self.activation_checkpointing,
                   "param_dtype": self.mixed_precision.param_dtype, "reduce_dtype": self.mixed_precision.reduce_dtype}
        if isinstance(self.hybrid_shard, int):
            options["hybrid_shard"] = self.hybrid_shard
        return options

    def _offload_activations(self) -> Any:
        """Activations saved for backward go to CPU memory (pinned when a GPU is used) and come back in backward."""
        return torch.autograd.graph.save_on_cpu(pin_memory=self.root_device.type == "cuda")

    def _units_to_compile(self, module: nn.Module) -> list[nn.Module]:
        """The modules the wrap policy chooses (on one rank the engine keeps no units of its own: engine.py)."""
        return [m for _, m in policy_modules(module, self.auto_wrap_policy) if any(True for _ in m.parameters())]

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.activation_checkpointing is not None:
            apply_activation_checkpointing(module, self.activation_checkpointing)
        return super().setup_module(module)

    def __repr__(self) -> str:
        return (f"FSDPStrategy(reshard_after_forward={self.reshard_after_forward}, cpu_offload={self.cpu_offload}, "
                f"mixed_precision={self.mixed_precision})")
