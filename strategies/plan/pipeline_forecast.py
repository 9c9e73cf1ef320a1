"""The step-time forecast under a pipeline (strategies/pipeline_parallel.py), on the rank that sets its pace.

A schedule runs M micro-batches through P pipeline ranks holding V stages each (1 under GPipe and 1F1B, 2 under
the others: `stages_per_rank`) in M + (P - 1) / V slots, each one micro-batch's forward and backward through one
rank's stages; (P - 1) / V of them are the bubble, where a rank waits for the pipeline to fill or drain. Every rank
keeps the pace of the slowest, the one whose stages compute the most (the first holds the embedding, the last the
output layer and the loss). Also on its path:

- the activations sent from stage to stage, and their gradients back: each slot receives a micro-batch and sends
  it on. Where communication overlaps compute (a GPU's streams) only the pipeline's fill and drain wait for them,
  2 (P - 1) transfers; where it does not (gloo, on the cores that compute) every slot's two transfers add to it;
- data parallel: the engine holds its gradient sync back until the batch's last backward, so the stage's
  reductions follow the pipeline with nothing left to overlap; fsdp gathers each unit once, before the first
  micro-batch's forward, and keeps it gathered; zero1 and zero2 gather the updated parameters after the step.

The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) would fill the bubble with deferred
weight-gradient work; this engine computes weight gradients with the input gradients, so they are timed as the
other two-stage schedules are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..pipeline_parallel import stage_ranks, stages_per_rank
from .compute import ComputeCost
from .forecast import Reductions, Timeline, Topology, optimizer_seconds
from .hardware import Hardware, Link
from .link import collective_seconds
from .report import StepForecast

if TYPE_CHECKING:
    from .model_bytes import PlannedUnit


@dataclass(frozen=True)
class PipelineShape:
    """`size` pipeline ranks running `schedule` over `microbatches` micro-batches."""

    schedule: str
    size: int
    microbatches: int

    @property
    def slots(self) -> float:
        """A rank's compute of one micro-batch, this many times: the micro-batches and the bubble."""
        return self.microbatches + (self.size - 1) / stages_per_rank(self.schedule, None, self.size)

    @property
    def last_stage_rank(self) -> int:
        stages = stages_per_rank(self.schedule, None, self.size) * self.size
        return stage_ranks(self.schedule, stages, self.size)[-1]


def stage_cost(cost: ComputeCost, held: list[str], last: bool) -> ComputeCost:
    """The part of one micro-batch's step through the whole model (`cost`, timed with the stages' modules as its
    regions) that a rank holding `held` computes: their share of forward, and of backward alike. What ran outside
    every region (the loss) is the last stage's."""
    regions = cost.region_forward
    mine = sum(regions.get(name, 0.0) for name in held) + regions.get("", 0.0) * last
    share = mine / (sum(regions.values()) or 1.0)
    return replace(
        cost,
        forward=[("", cost.forward_total * share)],  # (tensor parallel's collectives included, where `cost` has them)
        backward=cost.backward * share,
        model_flops=cost.model_flops * share,
        region_forward={},
        region_output_bytes={},
    )


def forecast_pipeline_step(
    stage: ComputeCost,
    shape: PipelineShape,
    sent_bytes: int,
    p2p_link: Link,
    units: list[PlannedUnit],
    spec: Any,
    hardware: Hardware,
    topology: Topology,
    tokens: float,
    states: int,
    reduce_dtype: torch.dtype | None = None,
) -> StepForecast:
    """Replay one step of a strategy spreading one pipeline rank's stages (`stage`: one micro-batch's compute
    through them; `units`: their planned units) over its data-parallel ranks. `sent_bytes`: one micro-batch's
    activations at a stage boundary, sent over `p2p_link`."""
    line = Timeline(hardware, topology)
    reduce_itemsize = reduce_dtype.itemsize if reduce_dtype is not None else None
    if spec.shard_parameters:  # every unit gathered once, before the first forward; the first one waited for
        gathered = [line.issue("all_gather", _bytes(u, None), topology.shard_ranks) for u in units]
        line.compute(0.0, gathered[0] if gathered else 0.0)
    send_s = collective_seconds("send", sent_bytes, 2, p2p_link)
    transfers = 2 * shape.slots if not hardware.comm_overlaps_compute else 2 * (shape.size - 1)
    line.compute(shape.slots * stage.total + transfers * send_s)
    line.now = max(line.now, line.stream_free)  # (fsdp's gathers that compute did not hide)
    _sync_gradients(line, units, spec, topology, reduce_itemsize)
    line.now = max(line.now, line.stream_free)
    optimizer_s = optimizer_seconds(units, spec.shard_optimizer_state, states, hardware)
    line.compute(optimizer_s)
    if spec.shard_optimizer_state and not spec.shard_parameters:  # zero1, zero2: the updated parameters
        for u in units:
            line.issue("all_gather", _bytes(u, None), topology.world_size)
    step = max(line.now, line.stream_free)
    compute = shape.microbatches * stage.total
    return StepForecast(
        step_s=step,
        tokens_per_s_per_rank=tokens / step,
        mfu=shape.microbatches * stage.model_flops / step / hardware.peak(stage.compute_dtype),
        exposed_comm_s=max(0.0, step - shape.slots * stage.total - optimizer_s),
        compute_s=compute,
        optimizer_s=optimizer_s,
        comm_s=line.comm_s + shape.slots * 2 * send_s,
    )


def _sync_gradients(
    line: Timeline, units: list[PlannedUnit], spec: Any, topology: Topology, reduce_itemsize: int | None
) -> None:
    """The stage's gradient reductions after the batch's last backward, as the engine's synchronize issues them."""
    trainable = [u for u in units if u.has_trainable]
    if not spec.shard_gradients:  # ddp, zero1: every bucket all-reduced
        for u in trainable:
            line.issue("all_reduce", _bytes(u, reduce_itemsize), topology.world_size)
        return
    replicas = topology.world_size // topology.shard_ranks  # hsdp: the shard all-reduced across the groups
    reductions = Reductions(line, "reduce_scatter", topology.shard_ranks)
    for u in trainable:
        reductions.ready(_bytes(u, reduce_itemsize))
        if replicas > 1:
            line.issue("all_reduce", _bytes(u, reduce_itemsize) // topology.shard_ranks, replicas)
    reductions.launch()


def _bytes(unit: PlannedUnit, itemsize: int | None) -> int:
    return unit.layout.padded_total * (itemsize or unit.compute_dtype.itemsize)
