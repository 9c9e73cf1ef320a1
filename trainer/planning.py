"""The memory plan as the Trainer uses it: trainer.plan(module), and strategy="auto" decided by the plan."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from strategies import Strategy, get_strategy
from strategies.plan import MemoryPlan, device_memory_per_rank, format_bytes, parse_bytes, plan_memory

from .module import TrainModule

if TYPE_CHECKING:
    from .trainer import Trainer

AUTO_MARGIN = 0.9  # on GPUs, a plan must fit this share of the free memory (allocator caches, CUDA context)


def check_memory_budget(strategy: Any, max_memory_per_rank: Any) -> int | None:
    if max_memory_per_rank is None:
        return None
    budget = parse_bytes(max_memory_per_rank, "max_memory_per_rank")
    if strategy != "auto":
        name = strategy.name if isinstance(strategy, Strategy) else strategy
        raise ValueError(
            f"max_memory_per_rank={max_memory_per_rank!r} is for strategy='auto' (which picks a "
            f"strategy that fits it); with strategy={name!r} leave it out"
        )
    return budget


def _sample(loader: Any) -> Any:
    """One sample of a map-style DataLoader's dataset, or None."""
    try:
        return loader.dataset[0]
    except (AttributeError, TypeError, IndexError, KeyError, NotImplementedError):
        return None


def make_plan(
    trainer: Trainer,
    module: Any,
    batch_size: int | None = None,
    seq_len: int | None = None,
    train_dataloaders: Any = None,
    device_memory: int | None = None,
    forecast: bool = True,
    hardware: Any = None,
    tensor_parallel_plan: Any = None,
    tensor_parallel: int | None = None,
    context_parallel: int | None = None,
    pipeline_parallel: int | None = None,
) -> MemoryPlan:
    """The plan at the Trainer's world size and precision, with the options its strategy gives the plan. The batch
    is the module's example_input, else shaped like the train DataLoader's samples. `forecast` adds each
    strategy's step time on `hardware` (default: this machine's GPU kind, else cpu). At `tensor_parallel` ranks
    (default: the strategy's `tensor_parallel_size`) > 1, `tensor_parallel_plan` (default: the module's
    `tensor_parallel_plan()`) is the module's split, its paths under the module. `context_parallel` and
    `pipeline_parallel` default to the strategy's sizes; a pipeline runs the strategy's schedule and micro-batches,
    its stages cut by default (the plan does not take a `pipeline_split`)."""
    loader, sample = train_dataloaders, None
    if not callable(getattr(module, "example_input", None)):
        loader = loader if loader is not None else module.train_dataloader()
        sample = _sample(loader) if loader is not None else None
    batch_size = batch_size or getattr(loader, "batch_size", None) or 1
    options = trainer.strategy.plan_options()
    with _attached(module, trainer):  # its configure_model, run on a meta copy, may ask for the trainer's mesh
        return plan_memory(
            module,
            world_size=trainer.world_size,
            nodes=trainer.num_nodes,
            batch_size=batch_size,
            seq_len=seq_len,
            precision=trainer.precision.precision,
            device_memory=device_memory,
            sample=sample,
            forecast=forecast,
            hardware=hardware,
            tensor_parallel=tensor_parallel or trainer.strategy.tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan if tensor_parallel_plan is not None else _module_plan(module),
            context_parallel=context_parallel or trainer.strategy.context_parallel_size,
            pipeline_parallel=pipeline_parallel or trainer.strategy.pipeline_parallel_size,
            pipeline_schedule=trainer.strategy.pipeline_schedule,
            pipeline_microbatches=trainer.strategy.pipeline_microbatches,
            **options,
        )


@contextmanager
def _attached(module: Any, trainer: Trainer) -> Iterator[None]:
    """`module` attached to `trainer` while it is planned (as it is once fit starts), if it is not yet."""
    if not isinstance(module, TrainModule) or module._trainer is not None:
        yield
        return
    module._trainer = trainer
    try:
        yield
    finally:
        module._trainer = None


def _module_plan(module: Any) -> Any:
    plan = getattr(module, "tensor_parallel_plan", None)
    return plan() if callable(plan) else None


def local_device_memory(trainer: Trainer) -> int:
    """Free memory of this rank's GPU, or on CPU this machine's memory shared by the ranks of one node."""
    if trainer.strategy.root_device.type == "cuda":
        return torch.cuda.mem_get_info(trainer.strategy.root_device)[0]
    return device_memory_per_rank(max(1, trainer.world_size // trainer.num_nodes))[0]


def choose_strategy(trainer: Trainer, module: Any, train_dataloaders: Any) -> Strategy | None:
    """strategy="auto" once the module is known. On CPU without max_memory_per_rank: keep the constructor's choice
    (ddp, or single for one rank). Otherwise the budget is max_memory_per_rank or, on GPUs, the least free memory
    over ranks with a margin, and the least-communicating strategy whose plan fits it is chosen (one rank: single,
    if it fits at all). None keeps the strategy chosen in the constructor."""
    if trainer.max_memory_per_rank is None and trainer.accelerator != "cuda":
        return None
    if trainer.max_memory_per_rank is not None:
        budget = trainer.max_memory_per_rank
        why = f"max_memory_per_rank={format_bytes(budget)}"
    else:
        free = min(trainer.strategy.all_gather_object(local_device_memory(trainer)))
        budget = int(free * AUTO_MARGIN)
        why = f"{AUTO_MARGIN:.0%} of the {format_bytes(free)} free on the fullest GPU"
    plan = make_plan(trainer, module, train_dataloaders=train_dataloaders, forecast=False)
    tensor_parallel = context_parallel = pipeline_parallel = 1
    try:
        name = plan.choose(budget)
    except ValueError as error:
        split = _with_tensor_parallel(trainer, module, train_dataloaders, budget)
        if split is not None:
            tensor_parallel, plan, name = split
        elif (split := _with_pipeline_parallel(trainer, module, train_dataloaders, budget)) is not None:
            pipeline_parallel, plan, name = split
        elif (split := _with_context_parallel(trainer, module, train_dataloaders, budget)) is not None:
            context_parallel, plan, name = split
        else:
            raise ValueError(f"strategy='auto' with {why}: {error} (see trainer.plan(module))") from None
    explanation = plan.explain(name, budget)
    if trainer.world_size == 1:  # every strategy does one process's work on one rank: no engine needed
        name, explanation = "single", f"single: one rank, and its plan fits {format_bytes(budget)} ({explanation})"
    if tensor_parallel > 1:
        explanation += f", with tensor_parallel_size={tensor_parallel} (nothing fits without)"
    if pipeline_parallel > 1:
        explanation += f", with pipeline_parallel_size={pipeline_parallel} (the model fits no rank whole)"
    if context_parallel > 1:
        explanation += f", with context_parallel_size={context_parallel} (the sequence fits no rank whole)"
    if trainer.is_global_zero:
        print(f"strategy='auto' ({why}) chose {explanation}", flush=True)
    strategy = get_strategy(name)
    strategy.tensor_parallel_size, strategy.context_parallel_size = tensor_parallel, context_parallel
    strategy.pipeline_parallel_size = pipeline_parallel
    return strategy


def _with_tensor_parallel(
    trainer: Trainer, module: Any, train_dataloaders: Any, budget: int
) -> tuple[int, MemoryPlan, str] | None:
    """When no strategy fits: the smallest tensor-parallel size within a node (2, 4, 8, ...) at which one does,
    with that plan and strategy, for a module with a `tensor_parallel_plan()`; else None."""
    if _module_plan(module) is None:
        return None
    per_node = trainer.world_size // trainer.num_nodes
    size = 2
    while size <= per_node:
        if per_node % size == 0:
            plan = make_plan(trainer, module, train_dataloaders=train_dataloaders, forecast=False, tensor_parallel=size)
            fitting = plan.fitting(budget)
            if fitting:
                return size, plan, fitting[0]
        size *= 2
    return None


def _with_pipeline_parallel(
    trainer: Trainer, module: Any, train_dataloaders: Any, budget: int
) -> tuple[int, MemoryPlan, str] | None:
    """When no strategy fits even with tensor parallel: the fewest pipeline stages (2, 4, 8, ... dividing the ranks;
    the fewer, the smaller the bubble) at which one does, with that plan and strategy, for a module with a
    `pipeline_loss` (pipeline-ready, docs/strategies.md); else None. Consecutive ranks hold a stage, so stages
    meet across nodes, where only their activations travel."""
    if not callable(getattr(module, "pipeline_loss", None)):
        return None
    for size in (2**k for k in range(1, trainer.world_size.bit_length())):
        if trainer.world_size % size:
            continue
        try:
            plan = make_plan(
                trainer, module, train_dataloaders=train_dataloaders, forecast=False, pipeline_parallel=size
            )
        except ValueError:  # more stages than blocks, or a batch that does not divide into the micro-batches
            continue
        fitting = plan.fitting(budget)
        if fitting:
            return size, plan, fitting[0]
    return None


def _with_context_parallel(
    trainer: Trainer, module: Any, train_dataloaders: Any, budget: int
) -> tuple[int, MemoryPlan, str] | None:
    """When no strategy fits even with tensor parallel: the smallest context-parallel size (2, 4, 8, ... dividing the
    ranks and the sequence) at which one does, with that plan and strategy; else None."""
    size = 2
    while size <= trainer.world_size:
        if trainer.world_size % size == 0:
            try:
                plan = make_plan(
                    trainer, module, train_dataloaders=train_dataloaders, forecast=False, context_parallel=size
                )
            except ValueError:  # a sequence that does not split so
                plan = None
            fitting = plan.fitting(budget) if plan is not None else []
            if fitting:
                return size, plan, fitting[0]
        size *= 2
    return None
