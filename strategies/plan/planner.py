"""plan_memory: a model's bytes per rank under ddp, zero1, zero2 and fsdp, computed on a meta copy of it."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from ..context_parallel import planned_attention
from ..pipeline_split import repeated_blocks
from ..registry import STRATEGIES
from ..sharding.unit import gradient_buckets
from ..wrap import resolve_wrap_policy
from .activations import AUTOCAST, TRUE_DTYPES, step_activations
from .compute import AC_MODES, ComputeCost, compute_cost
from .forecast import Topology, forecast_step
from .hardware import Hardware, Link, default_hardware, get_hardware
from .model_bytes import OPTIMIZER_STATES, check_optimizer, model_state_bytes, optimizer_kind, plan_units
from .pipeline import check_microbatches, in_flight, largest_stage, rank_modules, stage_activations, stage_copy
from .pipeline_forecast import PipelineShape, forecast_pipeline_step, stage_cost
from .report import STRATEGY_ORDER, MemoryPlan, StepForecast
from .sizes import format_bytes, parse_bytes
from .tensor_parallel import TensorParallelCollectives, resolve_plan, split_for_one_rank, with_collectives

SCHEDULES = {"engine": 1, "fully_shard": 2}  # communication streams of each
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device (no data is copied), without the
    hooks and per-instance forwards a strategy may have installed, and with configure_model run (on meta)."""
    memo: dict[int, Any] = {}
    for t in chain(model.parameters(), model.buffers()):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")  # shape and dtype only: t may be sharded
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    trainer = getattr(model, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = trainer
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        for hooks in _HOOKS:
            getattr(module, hooks).clear()
        module.__dict__.pop("forward", None)  # e.g. activation checkpointing's wrapper of the original's forward
    if callable(getattr(clone, "configure_model", None)):
        with torch.device("meta"):
            clone.configure_model()
        _undo_tensor_parallel(clone)
    return clone


def _undo_tensor_parallel(model: nn.Module) -> None:
    """A configure_model that applied torch's tensor parallel (under a strategy's mesh) left DTensor parameters and
    the styles' hooks: the plan lays the split out itself (tensor_parallel.py), from the whole model."""
    split = False
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                whole = torch.empty(param.shape, dtype=param.dtype, device="meta")
                setattr(module, name, nn.Parameter(whole, param.requires_grad))
                split = True
    if split:
        for module in model.modules():
            for hooks in _HOOKS:
                getattr(module, hooks).clear()


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel split the plan lays out: `size` ranks a group, by `plan` (what parallelize_module
    takes, or a function of the model returning it; resolved on each copy)."""

    size: int = 1
    plan: Any = None


def _planning_copy(
    model: nn.Module, precision: str, tp: TensorParallel = TensorParallel()
) -> tuple[nn.Module, TensorParallelCollectives]:
    """A meta copy in the dtype the precision trains it in (one for the layout, one the fake pass swaps), as one
    tensor-parallel rank holds it; and the record its forward fills with the tensor-parallel collectives."""
    meta = meta_copy(model)
    if precision in TRUE_DTYPES:
        meta.to(TRUE_DTYPES[precision])
    if tp.size == 1:
        return meta, TensorParallelCollectives(1)
    return meta, split_for_one_rank(meta, resolve_plan(meta, tp.plan), tp.size)


def _check(
    world_size: int, nodes: int, batch_size: int, seq_len: int | None, precision: str, tp: int, cp: int = 1, pp: int = 1
) -> None:
    checked = (
        ("world_size", world_size),
        ("nodes", nodes),
        ("batch_size", batch_size),
        ("tensor_parallel", tp),
        ("context_parallel", cp),
        ("pipeline_parallel", pp),
    )
    for name, value in checked:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not valid; use a positive int")
    if world_size % nodes:
        raise ValueError(f"nodes={nodes} does not divide world_size={world_size}; use the same ranks on every node")
    if world_size % tp:
        raise ValueError(
            f"tensor_parallel={tp} does not divide world_size={world_size}: the ranks are groups of {tp} "
            "tensor-parallel ranks"
        )
    if world_size % (tp * cp * pp):
        with_pipeline = f" x pipeline_parallel={pp}" if pp > 1 else ""
        raise ValueError(
            f"tensor_parallel={tp} x context_parallel={cp}{with_pipeline} does not divide world_size={world_size}: "
            f"the ranks are groups of {tp * cp * pp} that train one batch together"
        )
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len={seq_len!r} is not valid; use a positive int or None")
    if cp > 1 and seq_len is not None and seq_len % cp:
        raise ValueError(f"seq_len={seq_len} does not split into context_parallel={cp} equal parts")
    if precision not in AUTOCAST:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {list(AUTOCAST)}")


def _optimizer_of(model: nn.Module) -> str:
    """The kind of optimizer model.configure_optimizers() returns (adamw for a module without one)."""
    if not callable(getattr(model, "configure_optimizers", None)):
        return "adamw"
    try:
        result = model.configure_optimizers()
    except Exception as error:
        raise ValueError(
            f"optimizer: {type(model).__name__}.configure_optimizers() failed on the meta device "
            f"({error!r}); pass the optimizer's name to the plan"
        ) from error
    if isinstance(result, dict):
        result = result["optimizer"]
    while isinstance(result, (tuple, list)):
        result = result[0]
    return optimizer_kind(result)


def default_seq_len(model: nn.Module) -> int | None:
    """The sequence length a model's config declares (block_size, max_seq_len, max_position_embeddings)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for name in ("block_size", "max_seq_len", "max_position_embeddings"):
            if isinstance(getattr(config, name, None), int):
                return getattr(config, name)
    return None


def plan_memory(
    model: nn.Module,
    world_size: int = 1,
    nodes: int = 1,
    batch_size: int = 1,
    seq_len: int | None = None,
    precision: str = "32",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str | None = None,
    wrap_policy: Any = None,
    activation_checkpointing: Any = None,
    device_memory: int | str | None = None,
    sample: Any = None,
    hybrid_shard: int | None = None,
    foreach: bool | None = None,
    hardware: str | Hardware | None = None,
    checkpoint_mode: str = "full",
    schedule: str = "engine",
    forecast: bool = True,
    tensor_parallel: int = 1,
    tensor_parallel_plan: Any = None,
    context_parallel: int = 1,
    pipeline_parallel: int = 1,
    pipeline_schedule: str = "1F1B",
    pipeline_microbatches: int | None = None,
) -> MemoryPlan:
    """Bytes per rank for every strategy. `model` (an nn.Module or TrainModule, best built on the meta device) is
    not changed. `batch_size` and `seq_len` are per rank (seq_len defaults to the model config's); `param_dtype`
    and `reduce_dtype` are MixedPrecision's; `optimizer` an OPTIMIZER_STATES name (default: what the module's
    configure_optimizers returns, else adamw); `wrap_policy` and `activation_checkpointing` take FSDPStrategy's
    forms (no wrap policy: the whole model is one fsdp unit); `sample` is one sample of the training data, whose
    shapes make the batch when the module has no example_input. `hybrid_shard` (default: the ranks of one node
    when there are several nodes) adds hsdp: fsdp sharded within groups of that many ranks. `foreach`: whether
    the optimizer steps with torch's foreach kernels (default: as torch chooses for this machine's device).

    Each strategy also gets a step-time forecast on `hardware` (a HARDWARE name, a Hardware, or a file --measure
    wrote; default: this machine's GPU kind, else "cpu"): `plan.forecasts[name]`. `checkpoint_mode` "selective"
    runs activation checkpointing with torchtitan's per-op policy (torch.utils.checkpoint's selective contexts),
    for memory and time. `schedule` "fully_shard" times torch's FSDP2 schedule instead of this engine's (for
    comparing the forecast with published fully_shard runs): reductions on a stream of their own, normalization
    layers inside their block's unit. `forecast=False` plans memory only.

    `tensor_parallel` > 1 splits each group of that many consecutive ranks by `tensor_parallel_plan` (what torch's
    parallelize_module takes, or a function of the model returning it) and the strategies shard over the
    world_size / tensor_parallel data-parallel ranks: memory, activations and compute are one tensor-parallel
    rank's, and the forecast adds the tensor-parallel collectives (tensor_parallel.py).

    `context_parallel` > 1 splits each sequence (`seq_len`, the whole sequence's) over that many ranks, which read
    the same samples ("ulysses", strategies/context_parallel.py): activations and compute are one rank's part of
    the sequence, attention all of it for 1/C of the heads with the buffers its all-to-alls hold, the model state
    is sharded over the data-parallel x context-parallel ranks, and the forecast adds the all-to-alls.

    `pipeline_parallel` > 1 cuts the model into stages as the strategies do (`pipeline_schedule`, its
    `pipeline_microbatches`, default one per stage): the model state is that of the pipeline rank holding the most
    parameters, sharded over its data-parallel ranks, and the activations those of the micro-batches its schedule
    keeps in flight (strategies/plan/pipeline.py); the forecast is the step of the rank whose stages compute the
    most, with its schedule's bubble and the activations sent between stages (pipeline_forecast.py)."""
    _check(world_size, nodes, batch_size, seq_len, precision, tensor_parallel, context_parallel, pipeline_parallel)
    if checkpoint_mode not in AC_MODES:
        raise ValueError(f"checkpoint_mode={checkpoint_mode!r} is not valid; choose one of {list(AC_MODES)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid; choose one of {list(SCHEDULES)}")
    hardware = get_hardware(hardware) if hardware is not None else default_hardware()
    tp = _tensor_parallel(model, tensor_parallel, tensor_parallel_plan)
    cp, pp = context_parallel, pipeline_parallel
    data_ranks = world_size // (tp.size * pp)  # the ranks that shard a stage's state: data-parallel x context-parallel
    per_node = data_ranks // nodes  # of them on one node: hsdp shards over them by default
    group = hybrid_shard if hybrid_shard is not None else (per_node if nodes > 1 and per_node > 1 else None)
    if group is not None and (not isinstance(group, int) or group < 1 or data_ranks % group):
        raise ValueError(f"hybrid_shard={group!r} must divide the {data_ranks} data-parallel ranks")
    meta, _ = _planning_copy(model, precision, tp)
    if not any(True for _ in meta.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters to plan")
    micro, held, share, whole, shape = batch_size, 1, 1.0, meta, None
    if pp > 1:  # one stage's state; the activations of one micro-batch, of the stage's share, held at once
        meta, share = largest_stage(meta, pp, pipeline_schedule)
        microbatches = check_microbatches(pipeline_schedule, pp, pipeline_microbatches, batch_size)
        micro, held = batch_size // microbatches, in_flight(pipeline_schedule, pp, microbatches)
        shape = PipelineShape(pipeline_schedule, pp, microbatches)
    optimizer = optimizer if optimizer is not None else _optimizer_of(whole)
    check_optimizer(optimizer)
    seq_len = seq_len if seq_len is not None else default_seq_len(whole)
    if cp > 1:
        seq_len, sample = _one_part(seq_len, sample, cp)
    part = seq_len // cp if seq_len is not None else None  # one rank's part of each sequence
    strategies = {name: STRATEGIES[name]() for name in STRATEGY_ORDER}  # least communication first
    # a hybrid strategy (hsdp) shards within a group of G ranks and replicates across the groups
    hybrid = {name for name, s in strategies.items() if getattr(s, "hybrid_shard", None) is not None}
    shard_over = {
        name: group if name in hybrid else data_ranks for name in strategies if group is not None or name not in hybrid
    }
    checkpointed = resolve_wrap_policy(activation_checkpointing)
    with planned_attention(cp) if cp > 1 else nullcontext():
        step = step_activations(
            _planning_copy(model, precision, tp)[0],
            micro,
            part,
            precision,
            param_dtype,
            checkpointed,
            sample,
            selective=checkpoint_mode == "selective",
        )
    if pp > 1:
        step = stage_activations(step, share, held)
    rows = {
        name: model_state_bytes(
            meta,
            strategies[name].spec,
            ranks,
            wrap_policy=wrap_policy,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            optimizer=optimizer,
            foreach=foreach,
            step=step,
            keep_gathered=pp > 1,  # fsdp's default under a pipeline: units stay gathered until their backward
        )
        for name, ranks in shard_over.items()
    }
    forecasts: dict[str, StepForecast] = {}
    if forecast:
        setting = StepSetting(
            hardware,
            world_size,
            nodes,
            seq_len,
            precision,
            param_dtype,
            reduce_dtype,
            optimizer,
            wrap_policy=wrap_policy,
            checkpointed=checkpointed,
            checkpoint_mode=checkpoint_mode,
            sample=sample,
            tp=tp,
        )
        if shape is not None:
            forecasts = _pipeline_forecasts(model, whole, strategies, shard_over, setting, micro, shape)
        else:
            forecasts = _forecasts(model, meta, strategies, shard_over, setting, batch_size, schedule, cp)
    budget = parse_bytes(device_memory, "device_memory") if device_memory is not None else None
    params = sum(p.numel() for p in meta.parameters())  # (a stage's, under a pipeline)
    cast = f", param dtype {str(param_dtype).removeprefix('torch.')}" if param_dtype else ""
    split = f" ({tp.size} tensor-parallel x {data_ranks} data-parallel)" if tp.size > 1 else ""
    if cp > 1:
        split = f" ({tp.size} tensor-parallel x {cp} context-parallel x {data_ranks // cp} data-parallel)"
    if pp > 1:
        split = f" ({pp} pipeline stages of {tp.size} tensor-parallel x {data_ranks} data-parallel)"
    description = [
        f"memory plan of {type(model).__name__} ({params / 1e6:,.1f}M parameters{' per rank' * (tp.size * pp > 1)}) on "
        f"{world_size} rank(s){split}, {nodes} node(s); per rank: batch {batch_size}"
        + (f" x {seq_len}" if seq_len else "")
        + (f" (each rank {part} of it)" if cp > 1 else "")
        + f", precision {precision}{cast}, optimizer {optimizer}",
        "fsdp units: "
        + ("by the wrap policy" if wrap_policy is not None else "the whole model is one unit")
        + (f"; hsdp shards within groups of {group} ranks" if group is not None else "")
        + ("; activation checkpointing by its policy" if activation_checkpointing is not None else "")
        + (" (selective: torchtitan's per-op policy)" if checkpoint_mode == "selective" else ""),
    ]
    if pp > 1:
        description.append(
            f"pipeline {pipeline_schedule}, {batch_size // micro} micro-batches of {micro}: the rank holding the most "
            f"parameters ({share:.0%} of the blocks), {held} micro-batches' activations in flight; the step is that "
            "of the rank computing the most"
        )
    if forecast:
        description.append(
            f"step time on {hardware.name}, {world_size // nodes} rank(s) per node (what the profile "
            "assumes: strategies/plan/hardware.py)"
        )
    if budget is not None:
        description.append(f"device memory per rank: {format_bytes(budget)}")
    return MemoryPlan(
        {name: replace(row, activations=step.saved, temporaries=step.temporaries) for name, row in rows.items()},
        world_size,
        nodes,
        budget,
        description,
        forecasts,
    )


@dataclass(frozen=True)
class StepSetting:
    """What every strategy's step forecast shares: the hardware and ranks it runs on, and what a step trains."""

    hardware: Hardware
    world_size: int
    nodes: int
    seq_len: int | None
    precision: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    optimizer: str
    wrap_policy: Any = None
    checkpointed: Any = None
    checkpoint_mode: str = "full"
    sample: Any = None
    tp: TensorParallel = field(default_factory=lambda: TensorParallel())

    def link(self, ranks: int) -> Link:
        """The link a group of `ranks` consecutive ranks talks over: within a node while they fit in one."""
        fits = ranks <= self.world_size // self.nodes
        return self.hardware.intra_node if fits else self.hardware.inter_node

    def cast_dtype(self, meta: nn.Module) -> torch.dtype | None:
        """The dtype the engine casts parameters to for compute, None where that is their own."""
        own = next(meta.parameters()).dtype
        return self.param_dtype if self.param_dtype is not None and self.param_dtype != own else None


def _timed_step(
    model: nn.Module, setting: StepSetting, batch_size: int, seq_len: int | None, regions: tuple[str, ...] = ()
) -> tuple[ComputeCost, float]:
    """One timed fake step of a fresh meta copy of `model` (split for tensor parallel) at `batch_size` x `seq_len`,
    tensor parallel's collectives on its clock, and their seconds."""
    timed, collectives = _planning_copy(model, setting.precision, setting.tp)
    cost = compute_cost(
        timed,
        setting.hardware,
        batch_size,
        seq_len,
        setting.precision,
        setting.param_dtype,
        setting.checkpointed,
        setting.checkpoint_mode,
        setting.sample,
        regions,
    )
    slowdown = setting.hardware.tensor_parallel_slowdown
    return with_collectives(cost, collectives, setting.link(setting.tp.size), slowdown)


def _forecasts(
    model: nn.Module,
    meta: nn.Module,
    strategies: dict[str, Any],
    shard_over: dict[str, int],
    setting: StepSetting,
    batch_size: int,
    schedule: str,
    cp: int = 1,
) -> dict[str, StepForecast]:
    """Each strategy's step on `setting.hardware`, from one timed fake step of a fresh meta copy of the model
    (under context parallel, of one rank's part of the sequence, with its attention's all-to-alls)."""
    tp, seq_len = setting.tp, setting.seq_len
    exchanged: list[int] = []
    with planned_attention(cp, exchanged) if cp > 1 else nullcontext():
        cost, tp_seconds = _timed_step(model, setting, batch_size, seq_len // cp if seq_len is not None else None)
    if cp > 1:  # each all-to-all of forward has its twin in backward
        exchanges = TensorParallelCollectives(cp, [("all_to_all", n) for n in exchanged])
        exchanges.backward = list(exchanges.forward)
        cost, cp_seconds = with_collectives(cost, exchanges, setting.link(tp.size * cp))
        tp_seconds += cp_seconds
    owners = [[name.rpartition(".")[0] for name, _ in bucket] for bucket in gradient_buckets(meta)]
    param_dtype = setting.cast_dtype(meta)
    tokens = batch_size * (seq_len or 1) / (tp.size * cp)  # a tp x cp group trains one batch together
    compute = cost.total - tp_seconds  # (what the step computes, the collectives on its clock aside)
    forecasts = {}
    for name, ranks in shard_over.items():
        spec = strategies[name].spec
        units = plan_units(
            meta, spec, ranks, setting.wrap_policy, param_dtype, full_precision_norms=schedule == "engine"
        )
        step = forecast_step(
            cost,
            units,
            spec,
            setting.hardware,
            Topology(setting.world_size // tp.size, setting.nodes, ranks),  # a data-parallel group
            tokens,
            OPTIMIZER_STATES[setting.optimizer],
            setting.reduce_dtype or param_dtype,
            owners if not spec.shard_parameters else None,
            SCHEDULES[schedule],
        )
        forecasts[name] = replace(
            step,
            compute_s=compute,
            comm_s=step.comm_s + tp_seconds,
            exposed_comm_s=max(0.0, step.step_s - compute - step.optimizer_s),
        )
    return forecasts


def _pipeline_forecasts(
    model: nn.Module,
    whole: nn.Module,
    strategies: dict[str, Any],
    shard_over: dict[str, int],
    setting: StepSetting,
    micro: int,
    shape: PipelineShape,
) -> dict[str, StepForecast]:
    """Each strategy's step under a pipeline (pipeline_forecast.py), from one timed fake step of one micro-batch
    through a fresh meta copy of the whole model, each rank's stages a region of it (`whole`: the planned copy)."""
    held = rank_modules(whole, shape.size, shape.schedule)
    regions = tuple(name for names in held.values() for name in names)
    cost, _ = _timed_step(model, setting, micro, setting.seq_len, regions)
    stages = {r: stage_cost(cost, names, last=r == shape.last_stage_rank) for r, names in held.items()}
    pace = max(stages, key=lambda r: stages[r].total)  # every rank keeps the slowest one's pace
    stage_meta, _ = stage_copy(whole, held[pace])
    sent = cost.region_output_bytes.get(f"{repeated_blocks(whole)}.0", 0)  # one block's output: a boundary's
    world_size, nodes, tp = setting.world_size, setting.nodes, setting.tp
    p2p_link = setting.link(world_size)  # across nodes when there are several: some stage boundary is between two
    param_dtype = setting.cast_dtype(whole)
    tokens = micro * shape.microbatches * (setting.seq_len or 1) / (tp.size * shape.size)
    forecasts = {}
    for name, ranks in shard_over.items():
        spec = strategies[name].spec
        units = plan_units(stage_meta, spec, ranks, setting.wrap_policy, param_dtype)
        forecasts[name] = forecast_pipeline_step(
            stages[pace],
            shape,
            sent,
            p2p_link,
            units,
            spec,
            setting.hardware,
            Topology(world_size // (tp.size * shape.size), max(1, nodes // shape.size), ranks),  # a stage's
            tokens,
            OPTIMIZER_STATES[setting.optimizer],
            setting.reduce_dtype or param_dtype,
        )
    return forecasts


def _one_part(seq_len: int | None, sample: Any, cp: int) -> tuple[int, Any]:
    """Under context parallel: the whole sequence's length (the sample's, if one is given: its first tensor's
    dimension 0) and the sample cut to one rank's part, as the Trainer cuts batches (strategies/context_parallel.py)."""
    leaves = [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
    seq_len = leaves[0].shape[0] if leaves else seq_len
    if seq_len is None or seq_len % cp:
        raise ValueError(f"context_parallel={cp} needs sequences that split into {cp} equal parts, got {seq_len}")
    if leaves:
        part = seq_len // cp
        sample = tree_map(
            lambda t: t[:part] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == seq_len else t, sample
        )
    return seq_len, sample


def _tensor_parallel(model: nn.Module, size: int, plan: Any) -> TensorParallel:
    if size == 1:
        return TensorParallel()
    if plan is None:
        raise ValueError(
            f"tensor_parallel={size} needs tensor_parallel_plan: the {{module path: ParallelStyle}} the model's "
            "configure_model gives torch's parallelize_module (or a function of the model returning it), e.g. "
            "examples.llama.tensor_parallel_plan"
        )
    return TensorParallel(size, plan)
