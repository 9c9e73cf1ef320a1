"""Fully sharded data parallel: parameters, gradients and optimizer state sharded; each unit's parameters are
all-gathered just before it computes and freed right after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .activation_checkpointing import apply_activation_checkpointing
from .base import Strategy
from .options import MixedPrecision, check_hybrid_shard, check_mixed_precision, shard_group_size
from .sharding import FULL_SHARD, UnitOptions
from .sharding.meta_init import deferred_init
from .sharding.unit import policy_modules
from .wrap import resolve_wrap_policy


class FSDPStrategy(Strategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state sharded over the ranks.

    The model is split into units; each unit's parameters are all-gathered just before it computes and freed
    right after. Without an `auto_wrap_policy` the whole model is one unit. A model built in `configure_model`
    (or under `model_init_context`) is created on the meta device and each rank materializes only its shards.

    Args:
        auto_wrap_policy: which modules become units: a set of module classes (each instance becomes a unit, e.g.
            a transformer block), a positive int (a module becomes a unit when it holds at least that many
            parameters outside its child units, as torch's `size_based_auto_wrap_policy`), or a callable
            `(module, name) -> bool`. `None`: the model is one unit. Modules can also be marked with
            `mark_as_unit`.
        cpu_offload: keep the parameter shards (and so the optimizer step) in CPU memory, pinned when a GPU is
            used; they are copied to the GPU when a unit is gathered.
        activation_checkpointing: which modules recompute their activations in backward instead of storing them
            (torch's non-reentrant checkpoint): the same forms as `auto_wrap_policy`; `None` for none.
        reshard_after_forward: free each unit's gathered parameters after its forward (gathered again for
            backward); `False` keeps them until backward: one all-gather per unit less, for more memory. `None`
            (the default): `True`, and `False` under pipeline parallel (as torchtitan: a stage's units stay
            gathered from a micro-batch's forward to its backward).
        mixed_precision: a `MixedPrecision`: units are gathered and compute in its `param_dtype` and gradients
            are reduced in its `reduce_dtype`; the master shards and optimizer state stay in the parameters' own
            dtype. `None` for no mixed precision.
        activation_offload: move the activations saved for backward to CPU memory
            (`torch.autograd.graph.save_on_cpu`, pinned when a GPU is used) and bring them back in backward.
        hybrid_shard: `None` (shard over every rank), `"node"` (shard within each machine's ranks, replicate
            across machines) or a group size G (shard within groups of G ranks, replicate across the groups): HSDP.
            `Trainer(strategy="hsdp")` is `FSDPStrategy(hybrid_shard="node")`.
        compile: which modules' `forward` to `torch.compile` in place, the engine's hooks staying outside:
            `None` or `False` (none), `True` (every wrapped unit; the model itself without a wrap policy), a set of
            module classes, or a callable `(module, name) -> bool`.
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
        TypeError: if `auto_wrap_policy` or `activation_checkpointing` is not one of the forms above; if
            `cpu_offload`, `reshard_after_forward` or `activation_offload` is not a bool; if `mixed_precision` is
            not a `MixedPrecision` or None; for a `compile` or `compile_options` of the wrong type.
        ValueError: if `hybrid_shard` is not one of the forms above.

    Example:
        ```python
        strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing={Block},
                                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        trainer = Trainer(strategy=strategy, devices=8)
        ```
    """

    name = "fsdp"
    spec = FULL_SHARD

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        cpu_offload: bool = False,
        activation_checkpointing: Any = None,
        reshard_after_forward: bool | None = None,
        mixed_precision: MixedPrecision | None = None,
        activation_offload: bool = False,
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
        self.auto_wrap_policy = resolve_wrap_policy(auto_wrap_policy)
        # Same forms as auto_wrap_policy: a set of classes, a minimum size or a callable.
        self.activation_checkpointing = resolve_wrap_policy(activation_checkpointing, "activation_checkpointing")
        for name, value in [
            ("reshard_after_forward", True if reshard_after_forward is None else reshard_after_forward),
            ("cpu_offload", cpu_offload),
            ("activation_offload", activation_offload),
        ]:
            if not isinstance(value, bool):
                raise TypeError(f"FSDPStrategy: {name} must be a bool, got {value!r}")
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload, self.activation_offload = cpu_offload, activation_offload
        self.mixed_precision = check_mixed_precision("FSDPStrategy", mixed_precision)
        self.hybrid_shard = check_hybrid_shard("FSDPStrategy", hybrid_shard)

    @contextmanager
    def model_init_context(self) -> Iterator[None]:
        """The context `configure_model` runs under: the model is built on the meta device, recording how each
        tensor is made, so no memory is used until each rank materializes its shards, unit by unit, with exactly
        the values the eager construction makes. Under tensor parallel, torch's `parallelize_module` in
        `configure_model` splits the meta tensors too, and each rank's pieces are replayed the same way."""
        with deferred_init() as record:
            self._init_record = record
            yield

    @property
    def reshards_after_forward(self) -> bool:
        """reshard_after_forward as it applies: as given, or by default `True` and `False` under a pipeline."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.pipeline_parallel_size == 1

    def engine_options(self) -> dict[str, Any]:
        options = UnitOptions(self.mixed_precision.param_dtype, self.mixed_precision.reduce_dtype, self.cpu_offload)
        return {
            "wrap_policy": self.auto_wrap_policy,
            "reshard_after_forward": self.reshards_after_forward,
            "unit_options": options,
            "shard_group_size": shard_group_size(self.hybrid_shard, self.data_parallel_size),
            "forward_context": self._offload_activations if self.activation_offload else None,
        }

    def plan_options(self) -> dict[str, Any]:
        options = {
            "wrap_policy": self.auto_wrap_policy,
            "activation_checkpointing": self.activation_checkpointing,
            "param_dtype": self.mixed_precision.param_dtype,
            "reduce_dtype": self.mixed_precision.reduce_dtype,
        }
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
        """Apply activation checkpointing, then shard `module` in place into units and return it (see
        `Strategy.setup_module`).

        Args:
            module: the model; tensors built on the meta device under `model_init_context` are materialized,
                each rank its own shards.

        Returns:
            `module` itself.
        """
        if self.activation_checkpointing is not None:
            apply_activation_checkpointing(module, self.activation_checkpointing)
        return super().setup_module(module)

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(reshard_after_forward={self.reshards_after_forward}, cpu_offload={self.cpu_offload}, "
            f"mixed_precision={self.mixed_precision})"
        )
