"""Compute time of one training step, from a forward and backward on fake tensors (shapes only, as the activation
plan runs them), each op timed on a hardware profile by a roofline:

- matmuls (every op torch's flop counter knows) take FLOPs / the achieved matmul rate of their input dtype;
- fused attention takes its FLOPs (halved when causal, as the kernel skips the masked half) / the attention rate;
- every other op moves its inputs and outputs through memory once: bytes / the achieved memory bandwidth;
- views cost nothing; every other op costs at least the profile's per-op overhead.

Forward time is kept per module that owns parameters, in the order modules run, so the forecast can tell which
unit or bucket each stretch of compute belongs to. Backward is timed as a whole (recomputation included, when
modules are checkpointed) and shared out in proportion to the forward. Activation checkpointing is run for real
(torch.utils.checkpoint), fully or selectively as torchtitan's per-op policy does (matmul outputs saved every other
one, attention outputs saved, the rest recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .activation_checkpointing import AC_MODES, ATTENTION_FORWARD, checkpoint_modules
from .activations import AUTOCAST, _norms_in_full_precision, example_batches, to_fake, training_loss
from .hardware import Hardware

_aten = torch.ops.aten
ATTENTION_BACKWARD = {
    op
    for op in (
        getattr(_aten, name, None)
        for name in (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
        )
    )
    if op is not None
}
NO_DATA_MOVED = {_aten._unsafe_view, _aten.detach, _aten.alias, _aten.lift_fresh}  # views in all but name


@dataclass
class ComputeCost:
    """Seconds of one training step's compute on one rank."""

    forward: list[tuple[str, float]] = field(default_factory=list)  # (module owning parameters, seconds) in order
    backward: float = 0.0  # recomputation included
    model_flops: float = 0.0  # forward + backward, without recomputation: what MFU counts
    compute_dtype: torch.dtype = torch.float32  # the dtype most matmul FLOPs ran in
    # forward seconds and output bytes of each region compute_cost was given (a pipeline's stages are made of them);
    # "" gathers what ran outside every region
    region_forward: dict[str, float] = field(default_factory=dict)
    region_output_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def forward_total(self) -> float:
        return sum(seconds for _, seconds in self.forward)

    @property
    def total(self) -> float:
        return self.forward_total + self.backward


def _arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = {a.name: v for a, v in zip(func._schema.arguments, args)}
    return {**named, **kwargs}


def attention_flops(func: Any, args: tuple, kwargs: dict) -> float:
    """FLOPs of a fused attention op: QK^T and PV, 4 b h s_q s_k d forward, 2.5 times that backward."""
    named = _arguments(func, args, kwargs)
    query, key = named["query"], named["key"]
    b, h, s_q, d = query.shape
    flops = 4.0 * b * h * s_q * key.shape[-2] * d
    if func._overloadpacket in ATTENTION_BACKWARD:
        flops *= 2.5
    return flops / 2 if named.get("is_causal") else flops


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class OpClock(TorchDispatchMode):
    """Adds up each op's roofline time, attributing forward time to the module that is running."""

    def __init__(self, hardware: Hardware) -> None:
        super().__init__()
        self.hardware = hardware
        self.owners: list[str] = [""]  # the innermost running module that owns parameters
        self.regions: list[str] = [""]  # the running region (compute_cost's `regions`)
        self.in_backward = False
        self.cost = ComputeCost()
        self.flops_by_dtype: dict[torch.dtype, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim" or func.is_view or func._overloadpacket in NO_DATA_MOVED:
            return out
        seconds, flops, dtype = self._time(func, args, kwargs, out)
        seconds = max(seconds, self.hardware.op_overhead)
        if self.in_backward:
            self.cost.backward += seconds
        else:
            forward = self.cost.forward
            if forward and forward[-1][0] == self.owners[-1]:
                forward[-1] = (forward[-1][0], forward[-1][1] + seconds)
            else:
                forward.append((self.owners[-1], seconds))
            region = self.regions[-1]
            self.cost.region_forward[region] = self.cost.region_forward.get(region, 0.0) + seconds
        if flops and dtype is not None:
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0.0) + flops
        return out

    def _time(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, float, torch.dtype | None]:
        hardware, inputs = self.hardware, _tensors((args, kwargs))
        dtype = inputs[0].dtype if inputs else None
        if func._overloadpacket in ATTENTION_FORWARD or func._overloadpacket in ATTENTION_BACKWARD:
            flops = attention_flops(func, args, kwargs)
            return flops / (hardware.matmul_rate(dtype) * hardware.attention_fraction), flops, dtype
        if func._overloadpacket in flop_registry:
            flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
            return flops / hardware.matmul_rate(dtype), flops, dtype
        moved = sum(t.numel() * t.element_size() for t in inputs + _tensors(out))
        return moved / hardware.memory_bandwidth, 0.0, None

    def enter(self, module_name: str) -> Callable[..., None]:
        def push(_module: nn.Module, _args: tuple) -> None:
            self.owners.append(module_name)

        return push

    def leave(self, _module: nn.Module, _args: tuple, _output: Any) -> None:
        self.owners.pop()

    def enter_region(self, name: str) -> Callable[..., None]:
        def push(_module: nn.Module, _args: tuple) -> None:
            self.regions.append(name)

        return push

    def leave_region(self, _module: nn.Module, _args: tuple, output: Any) -> None:
        name = self.regions.pop()
        if not self.in_backward:  # (not a checkpointed region's recomputation)
            self.cost.region_output_bytes.setdefault(name, sum(t.nbytes for t in _tensors(output)))


def compute_cost(
    model: nn.Module,
    hardware: Hardware,
    batch_size: int,
    seq_len: int | None = None,
    precision: str = "32",
    param_dtype: torch.dtype | None = None,
    checkpointed: Callable[[nn.Module, str], bool] | None = None,
    checkpoint_mode: str = "full",
    sample: Any = None,
    regions: tuple[str, ...] = (),
) -> ComputeCost:
    """Seconds of one training step of `model` (a meta copy: its parameters are swapped for fake tensors) on
    `hardware`, per module that owns parameters in forward order, and the step's model FLOPs; and the forward time
    and output bytes of each submodule named in `regions`."""
    if checkpoint_mode not in AC_MODES:
        raise ValueError(f"checkpoint_mode={checkpoint_mode!r} is not valid; choose one of {list(AC_MODES)}")
    mode = FakeTensorMode()
    to_fake(model, mode, param_dtype)
    model.train()
    checkpoint_modules(model, checkpointed, checkpoint_mode)
    with mode:
        candidates = example_batches(model, batch_size, seq_len, sample)
    for i, (batch, targets) in enumerate(candidates):
        try:
            return _timed_step(model, mode, hardware, batch, targets, precision, param_dtype, regions)
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError):
            if i == len(candidates) - 1:
                raise
    raise AssertionError("unreachable")


def _timed_step(
    model: nn.Module,
    mode: FakeTensorMode,
    hardware: Hardware,
    batch: Any,
    targets: Any,
    precision: str,
    param_dtype: torch.dtype | None,
    regions: tuple[str, ...] = (),
) -> ComputeCost:
    clock = OpClock(hardware)
    with ExitStack() as stack:
        handles = _norms_in_full_precision(model) if param_dtype is not None else []
        for name in regions:
            region = model.get_submodule(name)
            handles.append(region.register_forward_pre_hook(clock.enter_region(name)))
            handles.append(region.register_forward_hook(clock.leave_region))
        for name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(clock.enter(name)))
                handles.append(module.register_forward_hook(clock.leave))
        stack.callback(lambda: [h.remove() for h in handles])
        stack.enter_context(mode)
        stack.enter_context(clock)
        autocast = AUTOCAST[precision]
        with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
            loss = training_loss(model, batch, targets)
        forward_flops = sum(clock.flops_by_dtype.values())
        clock.in_backward = True
        loss.backward()
    cost = clock.cost
    cost.model_flops = 3 * forward_flops  # backward is twice the forward's FLOPs; recomputation is not counted
    if clock.flops_by_dtype:
        cost.compute_dtype = max(clock.flops_by_dtype, key=clock.flops_by_dtype.get)
    return cost
