"""Pipeline parallel: the ranks of a pipeline group each hold some stages of the model, and torch's pipeline
schedules (`torch.distributed.pipelining`) run the micro-batches of every batch through them, forward and backward.

How a step goes (the Trainer calls `train_step` in place of training_step and backward):
- the batch `(inputs, target)` is cut into `pipeline_microbatches` micro-batches along dimension 0; the first
  stage reads the inputs, the last the target;
- the schedule runs the stages' forwards and backwards in its order; on the last stage the module's
  `pipeline_loss(output, target)` gives each micro-batch's loss, divided here by the number of micro-batches, so
  the gradients are those of the batch's mean loss, as one process computes them;
- the sharding engine works from its hooks as in any backward, its gradient sync held back until the batch's last
  backward is done (`no_sync`, then `synchronize`);
- what `pipeline_loss` logs is averaged over the micro-batches and sent from the last stage to every rank of the
  pipeline, where the Trainer logs it (so rank 0, on the first stage, logs one process's mean).

Stages and ranks: single-stage schedules (GPipe, 1F1B) put stage s on rank s; the multi-stage ones put two stages on
each rank by default, stage s on rank s mod P (a loop), the V-shaped ones (ZBVZeroBubble, DualPipeV) rank r's as
r and 2P - 1 - r. A rank's model holds its stages' modules (pipeline_split.py); each stage runs a view of it.

Zero-bubble schedules split a backward into its input and weight halves; here the weight gradients are computed with
the input ones (a full backward, through the engine's hooks), so those schedules keep their order of micro-batches
and their exact numbers, but not the filling of the bubble by deferred weight work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules

from .pipeline_split import check_split, default_split, keep_only, stage_view

SCHEDULES = {
    "GPipe": schedules.ScheduleGPipe,
    "1F1B": schedules.Schedule1F1B,
    "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
    "DualPipeV": schedules.ScheduleDualPipeV,
}
SINGLE_STAGE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def check_schedule(owner: str, schedule: Any) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"{owner}: pipeline_schedule={schedule!r}; choose one of {list(SCHEDULES)}")
    return schedule


def check_microbatches(owner: str, value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{owner}: pipeline_microbatches={value!r}; choose a positive int (or None: one per stage)")


def stages_per_rank(schedule: str, split: list[list[str]] | None, size: int) -> int:
    """How many stages each rank holds: the split's stages over the ranks, else 1 (single-stage schedules) or 2."""
    if split is None:
        return 1 if schedule in SINGLE_STAGE else 2
    if len(split) % size:
        raise ValueError(
            f"pipeline_split has {len(split)} stages for pipeline_parallel_size={size}; give a multiple of {size}"
        )
    per_rank = len(split) // size
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs one stage per rank: pipeline_split must have {size} stages, not "
            f"{len(split)} (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV run more)"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs two stages per rank: pipeline_split must have {2 * size} stages, "
            f"not {len(split)}"
        )
    return per_rank


def stage_ranks(schedule: str, stages: int, size: int) -> list[int]:
    """The pipeline rank of each stage."""
    if schedule in V_SHAPED:
        return [s if s < size else 2 * size - 1 - s for s in range(stages)]
    return [s % size for s in range(stages)]


def least_microbatches(schedule: str, size: int, stages: int) -> int:
    """The fewest micro-batches a schedule runs with (below it torch's schedules fail or wait forever)."""
    if schedule == "GPipe":
        return 1
    return stages if schedule in V_SHAPED or schedule == "1F1B" else size


class PipelineParallel:
    """This rank's place in its pipeline group: `size` ranks, this one `rank`, running `schedule` over
    `microbatches` micro-batches (None: as many as stages) on the stages of `split` (None: the default cut)."""

    def __init__(
        self,
        size: int,
        rank: int,
        schedule: str,
        microbatches: int | None,
        split: list[list[str]] | None,
        group: Any,
        device: torch.device,
    ) -> None:
        self.size, self.rank, self.schedule_name = size, rank, schedule
        self.group, self.device = group, device
        self.per_rank = stages_per_rank(schedule, split, size)
        self.num_stages = self.per_rank * size
        self.microbatches = microbatches or self.num_stages
        least = least_microbatches(schedule, size, self.num_stages)
        if self.microbatches < least:
            raise ValueError(
                f"pipeline_microbatches={self.microbatches}: pipeline_schedule={schedule!r} over {self.num_stages} "
                f"stages on {size} ranks needs at least {least} micro-batches"
            )
        self.given_split = split
        self.split: list[list[str]] = []
        self.stage_indices: list[int] = []  # the stages this rank holds
        self.views: list[nn.Module] = []  # a module for each of them
        self.module: nn.Module | None = None
        self.names_in_order: list[str] = []  # the whole model's state dict keys
        self.whole_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}  # and their shapes
        self._schedules: dict[tuple, Any] = {}  # by the inputs' shape and dtype (a stage's shapes are fixed)

    # ---- the model's stages ---------------------------------------------------------------------------------
    def cut(self, module: nn.Module) -> None:
        """Keep this rank's stages of `module` in place (the other modules become None), and a view per stage."""
        given = self.given_split if self.given_split is not None else default_split(module, self.num_stages)
        self.split = check_split(module, given)  # (the default one too: a tied weight may straddle its stages)
        if not callable(getattr(module, "pipeline_loss", None)):
            raise TypeError(
                f"pipeline_parallel_size={self.size}: {type(module).__name__} has no pipeline_loss(output, target); "
                'the last stage computes the loss of each micro-batch with it (docs/strategies.md, "Deep models")'
            )
        ranks = stage_ranks(self.schedule_name, self.num_stages, self.size)
        self.stage_indices = [s for s in range(self.num_stages) if ranks[s] == self.rank]
        held = [name for s in self.stage_indices for name in self.split[s]]
        whole = module.state_dict()
        self.names_in_order = list(whole)
        self.whole_shapes = {name: (value.shape, value.dtype) for name, value in whole.items()}
        keep_only(module, held)
        self.module = module
        if len(self.stage_indices) == 1:
            self.views = [module]
        else:
            self.views = [stage_view(module, self.split[s]) for s in self.stage_indices]

    def stored(self, model_state: Any) -> Any:
        """The model's state as checkpoints hold it (ModelShards), its `shapes` those of the whole model: this
        rank's own, the other stages' as the model had them before it was cut."""
        return _EveryStage(model_state, self.whole_shapes)

    def whole_model(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every stage's entries of a state dict keyed by the model's names (this rank's `state` with the other
        ranks'), in the model's order. Collective over the pipeline group."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=self.group)
        merged = {k: v for part in parts for k, v in part.items()}
        order = {name: i for i, name in enumerate(self.names_in_order)}
        return {k: merged[k].to(self.device) for k in sorted(merged, key=lambda k: order.get(k, len(order)))}

    def names_of_every_stage(self, names: list[str]) -> list[str]:
        """`names` of this rank's stages with the other ranks', in the model's order. Collective over the group."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, list(names), group=self.group)
        order = {name: i for i, name in enumerate(self.names_in_order)}
        return sorted({n for part in parts for n in part}, key=lambda n: order.get(n, len(order)))

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def last_stage_rank(self) -> int:
        return stage_ranks(self.schedule_name, self.num_stages, self.size)[-1]

    def _schedule(self, inputs: torch.Tensor, loss_fn: Callable) -> Any:
        """torch's training schedule over this rank's stages for batches of `inputs`' shape. It is told each
        stage's input and output shapes (found by a forward-only run of the batch), because torch's own way of
        finding them runs a backward whose gradients would reach the engine's reductions."""
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._schedules:
            shapes = self._stage_shapes(inputs)  # (on every rank of the pipeline: a forward through it)
            stages = [
                pipelining.PipelineStage(
                    view,
                    index,
                    self.num_stages,
                    self.device,
                    group=self.group,
                    dw_builder=lambda: _no_weight_work,
                    **shape,
                )
                for view, index, shape in zip(self.views, self.stage_indices, shapes)
            ]
            cls = SCHEDULES[self.schedule_name]
            stage = stages[0] if self.schedule_name in SINGLE_STAGE else stages
            self._schedules[key] = cls(stage, self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def _stage_shapes(self, inputs: torch.Tensor) -> list[dict[str, Any]]:
        """Each of this rank's stages' input and output of one micro-batch, as meta tensors: from a forward-only
        run of the batch through the pipeline (under the random state of before it)."""
        seen: dict[int, tuple[Any, Any]] = {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.forward(inputs, seen)
        return [
            {
                "input_args": (_meta_of(seen[index][0], needs_grad=index > 0),),
                "output_args": (_meta_of(seen[index][1], needs_grad=True),),
            }
            for index in self.stage_indices
        ]

    def _check_batch(self, inputs: Any, target: Any) -> None:
        for what, tensor in (("inputs", inputs), ("target", target)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise TypeError(
                    f"pipeline_parallel_size={self.size}: a batch must be (inputs, target), two tensors of one batch "
                    f"dimension; its {what} is {type(tensor).__name__}"
                )
        self._check_divides(inputs)

    def _check_divides(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"pipeline_microbatches={self.microbatches}: a batch of {inputs.shape[0]} samples does not divide into "
                f"{self.microbatches} micro-batches; choose a batch size that is a multiple of it"
            )

    # ---- a step ---------------------------------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline; the loss of the batch (the micro-batches'
        mean) on the rank that holds the last stage, None on the others."""
        self._check_batch(inputs, target)
        module, microbatches = self.module, self.microbatches

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = module.pipeline_loss(output, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"pipeline_loss must return a scalar loss tensor, got {type(loss).__name__}")
            return loss.reshape(()) * (scale / microbatches)

        schedule = self._schedule(inputs, loss_fn)
        self._follow_mode()
        losses: list[torch.Tensor] = []
        with _missing_module_error(self):
            schedule.step(*self._first_stage_args(inputs), target=target, losses=losses)
        if not self.holds_last_stage:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / scale

    def forward(self, inputs: torch.Tensor | None, seen: dict | None = None) -> torch.Tensor | None:
        """The model's output of `inputs` (given on the rank holding the first stage), through the stages without
        backward, one micro-batch after another: on the rank holding the last stage (None on the others). With
        `seen`, each of this rank's stages' input and output of the first micro-batch by stage index."""
        ranks = stage_ranks(self.schedule_name, self.num_stages, self.size)
        if inputs is not None:
            self._check_divides(inputs)
        chunks = inputs.tensor_split(self.microbatches) if 0 in self.stage_indices else [None] * self.microbatches
        self._follow_mode()
        outputs = []
        with _missing_module_error(self), torch.no_grad():
            for number, x in enumerate(chunks):
                for index, view in zip(self.stage_indices, self.views):
                    if index > 0 and ranks[index - 1] != self.rank:
                        x = self._receive(ranks[index - 1])
                    y = view(x)
                    if seen is not None and number == 0:
                        seen[index] = (x, y)
                    if index + 1 < self.num_stages and ranks[index + 1] != self.rank:
                        self._send(y, ranks[index + 1])
                    x = y
                if self.holds_last_stage:
                    outputs.append(x)
        return torch.cat(outputs) if self.holds_last_stage else None

    def _follow_mode(self) -> None:
        """The stages' views in the model's mode (train or eval): a view's copies of the modules on the way to its
        own do not follow `module.train()` by themselves."""
        for view in self.views:
            if view is not self.module:
                view.train(self.module.training)

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        dist.send_object_list([tensor], group=self.group, group_dst=to, device=self.device)

    def _receive(self, source: int) -> torch.Tensor:
        box: list[Any] = [None]
        dist.recv_object_list(box, group=self.group, group_src=source, device=self.device)
        return box[0].to(self.device)

    def _first_stage_args(self, inputs: torch.Tensor) -> tuple:
        return (inputs,) if 0 in self.stage_indices else ()

    def send_from_last_stage(self, obj: Any) -> Any:
        """`obj` of the rank holding the last stage, on every rank of this pipeline group. Collective over it."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=self.last_stage_rank)
        return box[0]


class _EveryStage:
    """A stage's model state as checkpoints read and write it, its `shapes` the whole model's (what a checkpoint
    is checked against: the other stages' entries are neither missing nor unexpected)."""

    def __init__(self, inner: Any, whole_shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        self.inner, self.whole_shapes = inner, whole_shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {**self.whole_shapes, **self.inner.shapes()}


def _meta_of(tensor: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """A meta tensor of a stage's input or output shape (what PipelineStage takes to skip its own probing)."""
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return meta.requires_grad_(needs_grad and meta.is_floating_point())


def _no_weight_work() -> None:
    """The weight half of a zero-bubble backward: done already, with the input half (see the module's docstring)."""


@contextlib.contextmanager
def _missing_module_error(pipeline: PipelineParallel) -> Iterator[None]:
    """A forward that calls a module its stage does not hold fails with "'NoneType' object is not callable": say
    which modules the stage holds and what the convention is."""
    try:
        yield
    except TypeError as error:
        if "'NoneType' object is not callable" not in str(error):
            raise
        held = "; ".join(f"stage {s}: {pipeline.split[s]}" for s in pipeline.stage_indices)
        raise TypeError(
            f"pipeline parallel: the model's forward called a module that this rank's stage does not hold ({held}). "
            "A stage holds only its modules, the others are None: the forward must skip a module that is None "
            "(`x = self.tok_embeddings(x) if self.tok_embeddings is not None else x`)"
        ) from error
