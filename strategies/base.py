"""The Strategy contract: the small set of capabilities the Trainer asks of every strategy.

A strategy is a ShardingSpec plus options; all the work is done by the sharding engine. The Trainer sets up the
process group and device, then calls `setup_module`, `setup_optimizer`, `call`, `backward`, `clip_gradients`,
`optimizer_step` and the state functions below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .sharding import ShardingEngine, ShardingSpec
from .sharding import state_dict as engine_state
from .sharding.object_gather import gather_to_rank_zero

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "mean": dist.ReduceOp.SUM,
}


class Strategy:
    """Base strategy: subclasses set `spec` (what is sharded) and may add options."""

    name = "custom"
    spec: ShardingSpec = ShardingSpec()

    def __init__(self) -> None:
        self.engine: ShardingEngine | None = None
        self.root_device = torch.device("cpu")
        self.world_size = 1
        self.global_rank = 0

    # ---- environment --------------------------------------------------------------------------------
    def connect(self, device: torch.device, world_size: int, global_rank: int) -> None:
        """Called by the Trainer once the process group (if any) exists."""
        self.root_device, self.world_size, self.global_rank = device, world_size, global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self, name: str | None = None) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks (returns a new tensor; the input is left unchanged)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op={op!r}; choose one of {sorted(REDUCE_OPS)}")
        if not self.distributed:
            return tensor.clone()
        out = tensor.detach().clone().to(self.root_device)
        dist.all_reduce(out, op=REDUCE_OPS[op])
        return out / self.world_size if op == "mean" else out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.all_reduce(flag, op="min" if all else "max")
        return bool(flag.item())

    # ---- model and optimizer ------------------------------------------------------------------------
    def model_init_context(self) -> Any:
        """Context that `configure_model` runs under (fsdp builds on the meta device)."""
        return nullcontext()

    def engine_options(self) -> dict[str, Any]:
        return {}

    def setup_module(self, module: nn.Module) -> nn.Module:
        # Meta tensors (from configure_model under an init context) stay put; the engine materializes them.
        module._apply(lambda t: t if t.is_meta else t.to(self.root_device))
        self.engine = ShardingEngine(module, self.spec, device=self.root_device, **self.engine_options())
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.engine.setup_optimizer(optimizer)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a step method of the module (training_step, validation_step, ...)."""
        return self.engine.root_call(fn, *args)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    @contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Iterator[None]:
        """Skip gradient synchronisation for micro-batches that are not the last of an accumulation."""
        with self.engine.no_sync() if enabled else nullcontext():
            yield

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return self.engine.clip_grad_norm_(max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.step(optimizer)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.zero_grad()

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors this rank's optimizer reads (for loss-scaler checks)."""
        grads = [u.shard_grad if self.spec.shard_optimizer_state else u.grad_flat for u in self.engine.units]
        return [g for g in grads if g is not None]

    # ---- state --------------------------------------------------------------------------------------
    def model_state_pieces(self) -> dict[str, Any]:
        return engine_state.model_pieces(self.engine)

    def optimizer_state_pieces(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return engine_state.optimizer_pieces(self.engine, optimizer)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        engine_state.load_model_state(self.engine, state)
        self.engine.after_parameters_changed()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict, param_groups: list) -> None:
        engine_state.load_optimizer_state(self.engine, optimizer, state, param_groups)

    def gather_optimizer_state_pieces(self, optimizer: torch.optim.Optimizer) -> Iterator[list[dict] | None]:
        """Every rank's `optimizer_state_pieces`, sent to rank 0 one unit's parameters at a time. Collective.
        Yields, unit by unit, the list by rank on rank 0 and None on the others."""
        local = self.optimizer_state_pieces(optimizer)
        for unit in self.engine.units:
            part = {**local, "state": {n: local["state"][n] for n in unit.param_names if n in local["state"]}}
            if not self.distributed:
                yield [part]
                continue
            yield gather_to_rank_zero(part)

    def parameter_aliases(self) -> dict[str, str]:
        return engine_state.parameter_aliases(self.engine.module)

    def full_state_dict(self, rank_zero_only: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped model's state dict, gathered unit by unit. Collective. Every rank gets it; with
        `rank_zero_only` the other ranks get {} and hold at most one unit at a time."""
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_full_state_dict(rank_zero_only):
            out.update(part)
        if rank_zero_only and not self.is_global_zero:
            return {}
        for alias, first in self.parameter_aliases().items():
            out[alias] = out[first]
        order = list(self.engine.module.state_dict(keep_vars=True))
        return {k: out[k] for k in order}

    def iter_full_state_dict(self, rank_zero_only: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The unwrapped model's state-dict entries in full, one unit's parameters at a time (under their first
        name; tied aliases left out), then the other entries (buffers). Collective: every rank must iterate to
        the end; with `rank_zero_only` the other ranks get empty dicts."""
        keep = self.is_global_zero or not rank_zero_only
        for names, views in self.engine.iter_full_parameters():
            yield {n: v.detach().cpu().clone() for n, v in zip(names, views)} if keep else {}
        if not keep:
            return
        params = {id(p) for p in self.engine.module.parameters()}
        aliases = self.parameter_aliases()
        rest = {}
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            if id(value) not in params and key not in aliases:
                rest[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        yield rest

    def full_state_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every entry of the unwrapped model's state dict, without gathering anything."""
        params = {}
        for unit in self.engine.units:
            for name, shape in zip(unit.param_names, unit.layout.shapes):
                params[name] = (shape, unit.dtype)
        for alias, first in self.parameter_aliases().items():
            params[alias] = params[first]
        out = {}
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            out[key] = params.get(key) or (value.shape, value.dtype)
        return out

    def memory_report(self) -> dict[str, int]:
        from .sharding.memory import memory_report

        return memory_report(self.engine)

    def teardown(self) -> None:
        """Detach the engine from the module (see ShardingEngine.remove_hooks) and drop it."""
        if self.engine is not None:
            self.engine.remove_hooks()
        self.engine = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
