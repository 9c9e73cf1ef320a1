"""The Strategy contract: the small set of capabilities that differ between strategies.

A strategy is a ShardingSpec plus options; all the work is done by the sharding engine, driven by hooks: after
`setup_module` the model is an ordinary module (call it, `loss.backward()`), and the optimizer returned by
`setup_optimizer` steps this rank's shards (`optimizer.step()`, `optimizer.zero_grad()`). What is left here is
setting the two up, skipping gradient sync, gathering parameters for the user, and the state functions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_gather as differentiable_all_gather
from torch.utils._pytree import tree_map

from .checkpoint import plain_loop
from .compile import compile_in_place, modules_to_compile, resolve_compile
from .context_parallel import ContextParallel, check_method
from .parallel_dims import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    ParallelDims,
    ParallelGroups,
    check_size,
)
from .pipeline_parallel import PipelineParallel, check_microbatches, check_schedule
from .sharding import ShardingEngine, ShardingSpec, observe
from .sharding import gradients as engine_gradients
from .sharding import state_dict as engine_state
from .sharding.engine import engine_of
from .sharding.meta_init import InitRecord
from .sharding.state_dict import ModelShards, OptimizerShards
from .step_trace import ALL_REDUCE, Collective, StepTrace, identity
from .tensor_parallel import TensorParallelParameters, TensorParallelState

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "mean": dist.ReduceOp.SUM,
}


class Strategy:
    """How a model is spread over the data-parallel ranks: the base of every strategy.

    A strategy is a sharding spec (what is sharded: nothing, optimizer state, gradients, parameters) plus options;
    the work is done by one sharding engine. Give it to `Trainer(strategy=...)`, or use it in a plain loop (Lightning
    Fabric's names): after `setup_module` the model is an ordinary module (call it, `loss.backward()`), and the
    optimizer returned by `setup_optimizer` steps this rank's shards. Under `torchrun`, create the process group
    first; `setup_module` uses it.

    Subclasses set `spec` and may add options; the strategies to use are `SingleDeviceStrategy`, `DDPStrategy`,
    `ZeroStrategy` and `FSDPStrategy`.

    Example:
        ```python
        strategy = FSDPStrategy(auto_wrap_policy={Block})
        model = strategy.setup_module(model)
        optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters()))
        for x in loader:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        strategy.save("ckpt", {"model": model, "optimizer": optimizer, "step": 7})
        ```

    Args:
        compile: which modules' `forward` to `torch.compile` in place, the engine's hooks staying outside:
            `None` or `False` (none), `True` (the strategy's units: FSDP's wrapped modules; otherwise the model
            itself if it defines `forward`, else each child of it that holds parameters), a set of module
            classes, or a callable `(module, name) -> bool`.
        compile_options: keyword arguments for `torch.compile` (e.g. `{"mode": "max-autotune"}`).
        tensor_parallel_size: the ranks that split each layer with torch's tensor parallel, which the module
            applies in `configure_model` on `self.device_mesh["tensor_parallel"]` (1: none; "auto": the GPUs of
            one node). The strategy then shards the local pieces over the data-parallel ranks.
        context_parallel_size: the ranks that split each sequence (1: none). They read the same samples, the
            Trainer gives each its part of every sequence, and attention (`F.scaled_dot_product_attention`) is exact
            over the whole sequence; `self.device_mesh` gains "context_parallel" (docs/strategies.md, "Long
            sequences").
        context_parallel_method: `"ulysses"` (an all-to-all around attention trades the sequence for heads; any
            device; the heads must divide by context_parallel_size x tensor_parallel_size).
        pipeline_parallel_size: the ranks that hold the model's stages one after another (1: none); each stage is
            then spread by this strategy over its own ranks, and `self.device_mesh` gains "pipeline_parallel"
            (docs/strategies.md, "Deep models").
        pipeline_schedule: torch's pipeline schedule by its name without "Schedule": "GPipe", "1F1B",
            "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble" or "DualPipeV".
        pipeline_microbatches: the micro-batches each batch is cut into (None: one per stage).
        pipeline_split: the module names of each stage (a list of lists); None cuts the model's repeated blocks
            evenly, the modules before them going to the first stage and those after to the last.
        elementwise_optimizers: optimizer classes you declare element-wise (each element's update depends on that
            element alone), so that they step this rank's flat pieces; torch's are known and any other class is
            checked before its first step, so this is only needed for a class the check cannot build. A declared
            class that the check finds otherwise is refused (docs/optimizers.md).

    Raises:
        TypeError: if `compile` is an int or not one of the forms above, or `compile_options` is not a dict; if
            `elementwise_optimizers` holds something that is not an optimizer class.
        ValueError: if `tensor_parallel_size` is not a positive int or "auto", or (when the ranks are known) does
            not divide them.
    """

    name = "custom"
    spec: ShardingSpec = ShardingSpec()
    reseeds_each_stage = True
    """Whether the Trainer seeds every generator again from `seed_everything`'s seed at the start of each stage, as
    Lightning's data-parallel strategies do when they set up the process group (its single-device one does not)."""

    def __init__(
        self,
        compile: Any = None,
        compile_options: dict[str, Any] | None = None,
        tensor_parallel_size: int | str = 1,
        elementwise_optimizers: Iterable[type] = (),
        context_parallel_size: int = 1,
        context_parallel_method: str = "ulysses",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_split: list[list[str]] | None = None,
    ) -> None:
        owner = type(self).__name__
        self.engine: ShardingEngine | None = None
        self.elementwise_optimizers = check_elementwise_optimizers(owner, elementwise_optimizers)
        self.tensor_parallel_size = check_size(owner, "tensor_parallel_size", tensor_parallel_size, auto=True)
        self.context_parallel_size = check_size(owner, "context_parallel_size", context_parallel_size)
        self.context_parallel_method = check_method(owner, context_parallel_method)
        self.pipeline_parallel_size = check_size(owner, "pipeline_parallel_size", pipeline_parallel_size)
        self.pipeline_schedule = check_schedule(owner, pipeline_schedule)
        self.pipeline_microbatches = check_microbatches(owner, pipeline_microbatches)
        self.pipeline_split = pipeline_split
        self.pipeline: PipelineParallel | None = None  # this rank's stages and schedule, if any
        self.parallel_dims: ParallelDims | None = None  # every parallel dimension's size, once connected
        self._groups: ParallelGroups | None = None  # their mesh and process groups, made on first need
        self.context_parallel: ContextParallel | None = None  # this rank's context-parallel group, if any
        self.tensor_parallel: TensorParallelParameters | None = None  # the model's DTensor parameters, held locally
        self._init_record: InitRecord | None = None  # of the last model built under model_init_context
        self.root_device = torch.device("cpu")
        self.world_size = 1
        self.global_rank = 0
        self._connected = False
        self._trace: StepTrace | None = None  # the collectives of the running step (see `tracing`)
        self.compile = resolve_compile(type(self).__name__, compile)
        if compile_options is not None and not isinstance(compile_options, dict):
            raise TypeError(
                f"{type(self).__name__}: compile_options must be a dict of torch.compile's keyword "
                f"arguments (e.g. {{'mode': 'max-autotune'}}), got {compile_options!r}"
            )
        self.compile_options = dict(compile_options or {})

    # ---- environment --------------------------------------------------------------------------------
    def connect(self, device: torch.device, world_size: int, global_rank: int) -> None:
        """Set this rank's device, the world size and the rank. The Trainer calls it once the process group (if
        any) exists; `setup_module` calls it for a plain loop.

        Args:
            device: this rank's device.
            world_size: the number of ranks.
            global_rank: this rank.
        """
        self.root_device, self.world_size, self.global_rank = device, world_size, global_rank
        self._connected = True
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        sizes = (self.tensor_parallel_size, self.context_parallel_size, ranks_per_node, self.pipeline_parallel_size)
        dims = ParallelDims.resolve(world_size, *sizes)
        self.parallel_dims, self.tensor_parallel_size = dims, dims.tensor
        if dims.tensor > 1 or dims.context > 1 or dims.pipeline > 1:  # made now, on every rank together (collective)
            self._groups = ParallelGroups(dims, device.type)
        if dims.context > 1:
            group = self._groups.group(CONTEXT_PARALLEL)
            self.context_parallel = ContextParallel(dims.context, self.context_parallel_method, group, device)
        if dims.pipeline > 1 and dims.context > 1:
            raise ValueError(
                f"pipeline_parallel_size={dims.pipeline} with context_parallel_size={dims.context}: a pipeline "
                "does not split sequences yet; choose one of them (tensor parallel composes with either)"
            )
        if dims.pipeline > 1:
            self.pipeline = PipelineParallel(
                dims.pipeline,
                dims.pipeline_rank(global_rank),
                self.pipeline_schedule,
                self.pipeline_microbatches,
                self.pipeline_split,
                self._groups.group(PIPELINE_PARALLEL),
                device,
            )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of the ranks, dimensions "pipeline_parallel", "data_parallel", "context_parallel" and
        "tensor_parallel" (the data and tensor ones as Lightning's ModelParallelStrategy names them): in
        `configure_model`, apply torch's tensor parallel on `device_mesh["tensor_parallel"]`. Made on first use
        without tensor, context or pipeline parallel (collective then). In a plain loop under torchrun, read it
        before `setup_module` to split the model."""
        if not self._connected:
            self.connect(*_environment())
        if self._groups is None:
            self._groups = ParallelGroups(self.parallel_dims, self.root_device.type)
        return self._groups.mesh

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different samples: the world size over tensor, context and pipeline parallel's."""
        return self.world_size // self.ranks_per_data_parallel_rank

    @property
    def data_parallel_group(self) -> Any:
        """The process group of this rank's data-parallel ranks under tensor or context parallel (None without:
        all ranks): each tensor- or context-parallel group counted once."""
        return self._groups.group(DATA_PARALLEL) if self._splits_samples else None

    @property
    def gradient_group(self) -> Any:
        """The ranks that see different data and average gradients: data-parallel and context-parallel ranks at
        this rank's tensor-parallel position (None: all ranks). Metric objects sync over them."""
        return self._groups.gradient if self._groups is not None else None

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the data-parallel ranks (the ranks of one tensor- or context-parallel group
        share it)."""
        return self.data_parallel_rank_of(self.global_rank)

    def data_parallel_rank_of(self, rank: int) -> int:
        """The data-parallel place of global rank `rank`."""
        if self.parallel_dims is None:
            return rank // self.ranks_per_data_parallel_rank
        return self.parallel_dims.data_parallel_rank(rank)

    @property
    def ranks_per_data_parallel_rank(self) -> int:
        """The ranks that read the same samples (a tensor-, context- and pipeline-parallel group)."""
        return self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size

    def data_parallel_representatives(self) -> list[int]:
        """One global rank per data-parallel rank, in order: the one that holds a step's output (the first
        tensor- and context-parallel rank of the pipeline's last stage)."""
        per_stage = self.world_size // self.pipeline_parallel_size
        last_stage = (self.pipeline_parallel_size - 1) * per_stage
        step = self.tensor_parallel_size * self.context_parallel_size
        return list(range(last_stage, last_stage + per_stage, step))

    @property
    def _splits_samples(self) -> bool:
        return self.ranks_per_data_parallel_rank > 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0."""
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.world_size > 1

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank gets here. Collective.

        Args:
            name: not used (Lightning's signature).
        """
        if self.distributed:
            self._note(Collective("barrier"))
            with observe.collective("barrier", None, None):
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank `src` to every rank. Collective.

        Args:
            obj: the object (only `src`'s is used).
            src: the rank that sends.

        Returns:
            `src`'s object.
        """
        if not self.distributed:
            return obj
        self._note(Collective("broadcast"))
        box = [obj]
        with observe.collective("broadcast_object", None, None):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object. Collective.

        Args:
            obj: this rank's object.

        Returns:
            The objects, by rank.
        """
        if not self.distributed:
            return [obj]
        self._note(Collective("all_gather_object"))
        out: list[Any] = [None] * self.world_size
        with observe.collective("all_gather_object", None, None):
            dist.all_gather_object(out, obj)
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", data_parallel: bool = False) -> torch.Tensor:
        """Reduce a tensor across ranks. Collective.

        Args:
            tensor: this rank's tensor (left unchanged).
            op: `"mean"`, `"sum"`, `"max"` or `"min"`.
            data_parallel: over the data-parallel ranks only, each tensor-parallel group counted once (its ranks
                saw the same batch): what `self.log(..., sync_dist=True)` reduces over.

        Returns:
            A new tensor holding the result, on this rank's device.

        Raises:
            ValueError: for an unknown `op`.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op={op!r}; choose one of {sorted(REDUCE_OPS)}")
        if not self.distributed:
            return tensor.clone()
        self._note(Collective(ALL_REDUCE, (op, tuple(tensor.shape), str(tensor.dtype))))
        out = tensor.detach().clone().to(self.root_device)
        group, size = None, self.world_size
        if data_parallel and self._splits_samples:
            group, size = self.data_parallel_group, self.data_parallel_size
        with observe.collective("all_reduce", None, out.numel()):
            dist.all_reduce(out, op=REDUCE_OPS[op], group=group)
        return out / size if op == "mean" else out

    def average_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of `tensor` over the ranks that see different data (data-parallel and context-parallel ranks;
        each tensor-parallel group counted once). Collective.

        Args:
            tensor: this rank's tensor (left unchanged).

        Returns:
            A new tensor holding the mean.
        """
        out = tensor.detach().clone().to(self.root_device)
        if self.distributed:
            self._note(Collective(ALL_REDUCE, ("mean", tuple(tensor.shape), str(tensor.dtype))))
            with observe.collective("all_reduce", None, out.numel()):
                dist.all_reduce(out, group=self.gradient_group)
            out = out / (self.data_parallel_size * self.context_parallel_size)
        return out

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Every rank's tensors in `data`, stacked along a new first dimension of size `world_size`. Collective.

        Args:
            data: a tensor, or a tree (dicts, lists, tuples) of them; other leaves are left as they are.
            sync_grads: make the gather differentiable (`torch.distributed.nn`'s `all_gather`).

        Returns:
            `data`'s structure with each tensor gathered.
        """

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.to(self.root_device).contiguous()
            if not self.distributed:
                return tensor.unsqueeze(0)
            self._note(Collective("all_gather"))
            with observe.collective("all_gather", None, tensor.numel()):
                if sync_grads:
                    return torch.stack(differentiable_all_gather(tensor))
                out = [torch.empty_like(tensor) for _ in range(self.world_size)]
                dist.all_gather(out, tensor)
            return torch.stack(out)

        return tree_map(lambda x: gather(x) if isinstance(x, torch.Tensor) else x, data)

    # ---- a rank without a batch in an evaluation step (step_trace.py) -------------------------------
    @contextmanager
    def tracing(self, expected: list[Collective] | None = None) -> Iterator[StepTrace]:
        """Record the collectives made inside the block (one evaluation step); with `expected`, raise StepMismatch
        before any collective that is not the next of `expected`, and at the end if some are left."""
        trace = self._trace = StepTrace(expected)
        try:
            with self.engine.forward_hooks.observing(trace.unit_gather, trace.engine_collective):
                yield trace
        finally:
            self._trace = None
        trace.finish()

    def repeat(self, collectives: list[Collective]) -> None:
        """Take part in the collectives of a step this rank does not run (it has no batch): the same all-gathers
        of units, giving its own shards, and all-reduces of what adds nothing. They must all be repeatable."""
        for collective in collectives:
            if collective.kind == ALL_REDUCE:
                self.all_reduce(identity(collective, self.root_device), collective.detail[0])
            else:
                self.engine.forward_hooks.repeat_gather(collective.detail[0])

    @property
    def forward_gathers(self) -> bool:
        """Whether a forward pass of the model makes collectives by itself (fsdp over more than one rank)."""
        return self.engine is not None and self.engine.forward_gathers

    def _note(self, collective: Collective) -> None:
        if self._trace is not None:
            self._trace.add(collective)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on a decision across ranks. Collective.

        Args:
            decision: this rank's decision.
            all: `True`: the result is True only if every rank decided True; `False`: if any rank did.

        Returns:
            The agreed decision.
        """
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.all_reduce(flag, op="min" if all else "max")
        return bool(flag.item())

    # ---- model and optimizer ------------------------------------------------------------------------
    def model_init_context(self) -> Any:
        """The context `configure_model` runs under: for FSDP the model is built on the meta device and each rank
        materializes only its shards in `setup_module`; the other strategies build it normally."""
        return nullcontext()

    def engine_options(self) -> dict[str, Any]:
        return {}

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard `module` in place (moving it to this rank's device) and return it.

        It stays an ordinary module: call it, `loss.backward()`, and step the optimizer returned by
        `setup_optimizer`. Outside the Trainer (a plain loop under torchrun) the process group the user created is
        used; without one, a single CPU process.

        Args:
            module: the model; tensors built on the meta device under `model_init_context` are materialized.

        Returns:
            `module` itself.
        """
        if not self._connected:
            self.connect(*_environment())
        take_back(module)
        # Meta tensors (from configure_model under an init context) stay put; the engine materializes them.
        module._apply(lambda t: t if t.is_meta else t.to(self.root_device))
        record, self._init_record = self._init_record, None
        options = self.engine_options()
        if self.pipeline is not None:
            self.pipeline.cut(module)  # this rank's stages only
        if self.tensor_parallel_size > 1:
            self.tensor_parallel = TensorParallelParameters(module, self.device_mesh[TENSOR_PARALLEL])
        if self.tensor_parallel_size > 1 or self.pipeline is not None:
            # the engine averages and shards over the ranks at this stage and tensor-parallel position
            options["group"] = self.gradient_group
            options["every_data_parallel_group"] = self.parallel_dims.gradient_groups()
        self.engine = ShardingEngine(module, self.spec, device=self.root_device, init_record=record, **options)
        if self.tensor_parallel is not None:
            self.tensor_parallel.install()
            split = [(name, p) for name, p in module.named_parameters() if name in self.tensor_parallel.sharded_names()]
            self.engine.split_elsewhere(
                [p for _, p in split],
                self.device_mesh[TENSOR_PARALLEL].get_group(),
                [self.tensor_parallel.split(name) for name, _ in split],
            )
        if self.compile is not None:
            compile_in_place(
                modules_to_compile(module, self.compile, self._units_to_compile(module)), self.compile_options
            )
        return module

    def _units_to_compile(self, module: nn.Module) -> list[nn.Module]:
        """What compile=True compiles: the engine's units that are modules (fsdp's wrapped modules)."""
        return [u.module for u in self.engine.units if u.module is not None and u.module is not module]

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make `optimizer` step this rank's shards; call it after `setup_module`.

        Args:
            optimizer: an optimizer over the module's parameters.

        Returns:
            The same optimizer; its `step()` and `zero_grad()` drive the engine.
        """
        return self.engine.setup_optimizer(optimizer, self.elementwise_optimizers)

    def forward_context(self) -> AbstractContextManager:
        """The context of one forward pass of the model (the Trainer runs `training_step`, `validation_step`, ...
        in it): under context parallel, attention over the whole sequence too."""
        if self.context_parallel is None:
            return self.engine.forward_scope()
        stack = ExitStack()
        stack.enter_context(self.engine.forward_scope())
        stack.enter_context(self.context_parallel.active())
        return stack

    def backward_context(self) -> AbstractContextManager:
        """The context of a backward pass: under context parallel, the forward's attention and positions, for
        what activation checkpointing recomputes."""
        return nullcontext() if self.context_parallel is None else self.context_parallel.active()

    # ---- context parallel: what a step does with its batch (context_parallel.py) -----------------------------
    def split_sequence(self, batch: Any, dims: Any = None) -> Any:
        """This rank's part of the batch's sequences under context parallel (the batch itself otherwise); `dims`:
        the sequence dimension of each tensor (TrainModule.sequence_dims), None for the default rule. Collective
        over the context-parallel ranks."""
        return batch if self.context_parallel is None else self.context_parallel.split(batch, dims)

    def join_sequence_parts(self, output: Any) -> Any:
        """A prediction of this rank's part of the sequences, under context parallel made whole again (every
        tensor whose dimension 1 is a part's length). Collective over the context-parallel ranks."""
        return output if self.context_parallel is None else self.context_parallel.join(output)

    def weigh_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Under context parallel, the loss weighed so that the ranks' losses average to the mean over every
        counted token of the sequences (see context_parallel.py)."""
        return loss if self.context_parallel is None else self.context_parallel.weigh_loss(loss)

    def combine_sequence_parts(self, value: torch.Tensor) -> torch.Tensor:
        """A value a step logs, under context parallel the whole sequences' (each token counted once); collective
        over the context-parallel ranks."""
        if self.context_parallel is None or not self.context_parallel.is_active:
            return value
        return self.context_parallel.combine(value)

    # ---- pipeline parallel: a batch through the stages (pipeline_parallel.py) ---------------------------------
    def pipeline_step(self, batch: Any, scale: float = 1.0) -> torch.Tensor | None:
        """Forward and backward of a batch `(inputs, target)` through the pipeline's micro-batches, the loss
        multiplied by `scale` (1 / accumulated batches); the batch's loss on the rank holding the last stage, None
        on the others. Collective over the pipeline group."""
        inputs, target = _inputs_and_target(batch, self.pipeline_parallel_size)
        return self.pipeline.train_step(inputs, target, scale)

    def pipeline_forward(self, batch: Any) -> Any:
        """The model's output of the batch's inputs through the pipeline (no backward): on the rank holding the
        last stage, None on the others. Collective over the pipeline group."""
        inputs, _ = _inputs_and_target(batch, self.pipeline_parallel_size, need_target=False)
        return self.pipeline.forward(inputs)

    def from_last_stage(self, obj: Any) -> Any:
        """`obj` of the rank holding the pipeline's last stage, on every rank of its pipeline group (itself
        without a pipeline). Collective over the pipeline group."""
        return obj if self.pipeline is None else self.pipeline.send_from_last_stage(obj)

    def names_of_every_stage(self, names: list[str]) -> list[str]:
        """Parameter names of this rank's stages with those of the pipeline's other stages, in the model's order
        (what a checkpoint's optimizer groups list); `names` itself without a pipeline. Collective over it."""
        return names if self.pipeline is None else self.pipeline.names_of_every_stage(names)

    @contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Iterator[None]:
        """Skip gradient synchronisation inside the block, for micro-batches that are not the last of an
        accumulation (as DDP's `no_sync`); gradients accumulate locally.

        Args:
            enabled: `False` makes the context do nothing.
        """
        with self.engine.no_sync() if enabled else nullcontext():
            yield

    def synchronize_gradients(self) -> None:
        """Average the gradients that backward passes under no_backward_sync accumulated locally (when the pass
        that would have synchronised them did not happen). Collective."""
        self.engine.synchronize()

    def unsharded(self, module: nn.Module | None = None, write_back: bool = True) -> AbstractContextManager:
        """A context in which every parameter of `module` is there in full (master precision), to read and
        change in place; on exit each rank keeps its own slice of what was written, so write alike on every rank.
        Collective under FSDP (call it on every rank); replicated parameters are always full.

        Args:
            module: the set-up module or one of its submodules; `None` for the whole model.
            write_back: keep the changes on exit.

        Raises:
            RuntimeError: if used during the backward pass.
        """
        return self.engine.unsharded(module, write_back)

    def clip_gradients(
        self, max_norm: float, params: list[torch.Tensor] | None = None, algorithm: str = "norm"
    ) -> torch.Tensor | None:
        """Clip the gradients over every rank and shard. Collective.

        Args:
            max_norm: the largest norm (`"norm"`) or element magnitude (`"value"`).
            params: the parameters whose gradients are clipped; `None` for all.
            algorithm: `"norm"` (by their global L2 norm) or `"value"` (each element to `[-max_norm, max_norm]`).

        Returns:
            With `"norm"`, the global norm before clipping; with `"value"`, None.
        """
        if algorithm == "value":
            engine_gradients.clip_grad_value_(self.engine, max_norm, params)
            return None
        stages = None if self.pipeline is None else self.pipeline.group  # the norm over every stage's gradients
        return engine_gradients.clip_grad_norm_(self.engine, max_norm, params, also_over=stages)

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors this rank's optimizer reads (for loss-scaler checks)."""
        return engine_gradients.gradient_tensors(self.engine)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient in full, by name. Collective (call it on every rank); it holds
        them all at once, so it is for inspection, not for every step.

        Returns:
            A dict of parameter name to gradient tensor; parameters without a gradient are left out.
        """
        return engine_gradients.full_gradients(self.engine)

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """The module's parameters that `optimizer` steps.

        Args:
            optimizer: an optimizer returned by `setup_optimizer`.

        Returns:
            The parameters, as the module holds them.
        """
        return self.engine.optimizer_parameters(optimizer)

    # ---- checkpoints (Lightning Fabric's names) ---------------------------------------------------------
    def save(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Write a checkpoint of `state` at `path`, in the Trainer's DCP format. Collective: every rank calls it.

        The model and optimizers are written as each rank's pieces (nothing is gathered); every other entry is
        written from rank 0, an object with a `state_dict()` (a scheduler) as its state dict.

        Args:
            path: the checkpoint directory.
            state: what to save, such as `{"model": model, "optimizer": optimizer, "step": 7}`; the model and
                optimizers are the set-up ones.

        Raises:
            TypeError: if `state` is not a dict.
            RuntimeError: if `setup_module` was not called first.
            ValueError: if `state` does not hold the set-up model exactly once, holds another module, or uses the
                checkpoint's reserved key.
        """
        plain_loop.save(self.engine, repr(self), path, state, self._as_stored)

    def load(self, path: str | os.PathLike, state: dict[str, Any], trust_pickled: bool = False) -> dict[str, Any]:
        """Restore `state` in place from a checkpoint of `save` (or of the Trainer), written under any strategy and
        world size. Collective.

        The model and optimizers are loaded in place, resharded; entries with a `load_state_dict` are loaded
        through it; other entries are replaced in `state`.

        Args:
            path: the checkpoint directory.
            state: what to restore, with the same keys as were saved (e.g. `{"model": model, "optimizer": opt}`).
            trust_pickled: unpickle whatever the checkpoint holds. Only for a checkpoint whose writer you trust
                (unpickling can run code); by default only tensors, plain data and the project's state types.

        Returns:
            The checkpoint's entries that are not the model or an optimizer.

        Raises:
            TypeError: if `state` is not a dict.
            RuntimeError: if `setup_module` was not called first.
            ValueError: if `state` does not hold the set-up model exactly once, or holds another module; if the
                checkpoint does not fit the model (names, shapes) or lacks one of `state`'s keys; a
                `CheckpointError` (a ValueError) without `trust_pickled` if it holds pickled objects of other types.
        """
        return plain_loop.load(self.engine, path, state, trust_pickled, self._as_stored)

    # ---- state ----------------------------------------------------------------------------------------------
    def model_state(self) -> ModelShards:
        """The set-up model's state as checkpoints read and write it (docs/architecture.md, "Checkpoints"): each
        rank's own pieces, by parameter name, loaded in place under any strategy and world size."""
        return self._as_stored(ModelShards(self.engine))

    def optimizer_state(self, optimizer: torch.optim.Optimizer, group_names: list[list[str]]) -> OptimizerShards:
        """A set-up optimizer's state as checkpoints read and write it, keyed as torch's `get_state_dict` keys it
        (`group_names`: the parameter names of each group)."""
        return self._as_stored(OptimizerShards(self.engine, optimizer, group_names))

    def _as_stored(self, owner: Any) -> Any:
        """The engine's owner of state as checkpoints hold it: under tensor parallel in the full tensors' shapes;
        under pipeline parallel the model's checked against every stage's names."""
        stored = owner if self.tensor_parallel is None else TensorParallelState(owner, self.tensor_parallel)
        return stored if self.pipeline is None or not isinstance(owner, ModelShards) else self.pipeline.stored(stored)

    def master_pieces(self) -> list[engine_state.MasterPiece]:
        """This rank's pieces of the weights, nothing gathered: (name, shape, start, data, trainable), `data` a 1-D
        view of elements [start, start + numel) of the flattened parameter `name` of `shape`, in the master's
        precision. Under zero1, zero2, fsdp and hsdp they are the slices its optimizer steps; under ddp the
        slices of the replicated parameters it owns (and writes in checkpoints). Writing them writes the weights:
        write alike on every rank, then call `master_pieces_changed`. Under tensor parallel they are pieces of
        this rank's local pieces (`shape` the local piece's); checkpoints put them in place (TensorParallelState)."""
        return engine_state.master_pieces(self.engine)

    def master_pieces_changed(self) -> None:
        """The master pieces were written in place: bring every copy of the parameters up to date (fsdp: gathered
        units are dropped and gathered anew when used; zero1, zero2 and ddp: the pieces are all-gathered).
        Collective."""
        self.engine.after_master_pieces_changed()

    def describe(self) -> str:
        """The strategy's name, and under hybrid sharding the size of the groups that shard."""
        groups = self.engine.groups if self.engine is not None else None
        if groups is not None and groups.replicate is not None:
            return f"{self.name}, hybrid: sharded in groups of {groups.size}"
        return self.name

    def plan_options(self) -> dict[str, Any]:
        """The options of this strategy that the memory plan (strategies.plan.plan_memory) takes into account."""
        return {}

    def full_state_dict(self, rank_zero_only: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's plain state dict (original names and shapes), gathered unit by unit. Collective.

        Args:
            rank_zero_only: only rank 0 gets it; the other ranks get `{}` and hold at most one unit at a time.
            trainable_only: only the parameters that require grad (a LoRA adapter, for peft's
                `save_pretrained(..., state_dict=...)`); the frozen parameters are not gathered.

        Returns:
            A dict of name to full tensor.
        """
        keep = self.is_global_zero or not rank_zero_only
        if self.tensor_parallel is None and self.pipeline is None:
            return engine_state.full_state_dict(self.engine, keep=keep, trainable_only=trainable_only)
        full = engine_state.full_state_dict(self.engine, keep=True, trainable_only=trainable_only)
        if self.tensor_parallel is not None:  # pieces of the tensor-parallel ranks, put together on each
            layouts = self.tensor_parallel.layouts
            full = {k: self.tensor_parallel.full_tensor(k, v) if k in layouts else v for k, v in full.items()}
        if self.pipeline is not None:  # every stage's, on each rank of the pipeline
            full = self.pipeline.whole_model(full)
        return full if keep else {}

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (parameters, gradients, optimizer state, ...)."""
        from .sharding.memory import memory_report

        return memory_report(self.engine)

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of each parameter this rank holds between steps (under fsdp its shard)."""
        from .sharding.memory import parameter_bytes

        return parameter_bytes(self.engine)

    def teardown(self) -> None:
        """Detach the engine from the module (see ShardingEngine.remove_hooks) and drop it."""
        if self.engine is not None:
            self.engine.remove_hooks()
        self.engine = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_elementwise_optimizers(owner: str, value: Iterable[type]) -> tuple[type, ...]:
    """`elementwise_optimizers` as given, checked: optimizer classes."""
    classes = (value,) if isinstance(value, type) else tuple(value)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"{owner}: elementwise_optimizers takes optimizer classes (e.g. {{pytorch_optimizer.Lion}}), "
                f"got {cls!r}"
            )
    return classes


def _inputs_and_target(batch: Any, size: int, need_target: bool = True) -> tuple[Any, Any]:
    """The (inputs, target) of a batch that runs through a pipeline."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if not need_target and isinstance(batch, torch.Tensor):
        return batch, None
    raise TypeError(
        f"pipeline_parallel_size={size}: a batch must be (inputs, target): the first stage reads the inputs and "
        f"the last stage's pipeline_loss the target; got {type(batch).__name__}"
        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def take_back(module: nn.Module) -> None:
    """If a strategy set `module` up before (a fit by another Trainer), make it an ordinary module again: full
    parameters of its own, no hooks (ShardingEngine.release; collective under fsdp). Nothing otherwise."""
    previous = engine_of(module)
    if previous is not None:
        previous.release()


def _environment() -> tuple[torch.device, int, int]:
    """Device, world size and rank of a process group the user created (or of one process)."""
    if not dist.is_initialized():
        return torch.device("cpu"), 1, 0
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return device, dist.get_world_size(), dist.get_rank()
