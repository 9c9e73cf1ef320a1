"""The step-time forecast under a pipeline (strategies/pipeline_parallel.py), on the rank that sets its pace.

A schedule runs M micro-batches through P pipeline ranks holding V stages each (1 under GPipe and 1F1B, 2 under
the others: `stages_per_rank`) in M + (P - 1) / V slots, each one micro-batch's forward and backward through one
rank's stages; (P - 1) / V of them are the bubble, where a rank waits for the pipeline to fill or drain. Every rank
keeps the pace of the slowest, the one whose stages compute the most (the first holds the embedding, the last the
output layer and the loss). Also on its path:

- the activations sent from stage to stage, and their gradients back: each slot receives a micro-batch and sends
  it on. Where communication overlaps compute (a GPU's streams) only the pipeline's fill and drain wait for them,
  2 (P - 1) transfers; where it does not (gloo, on the cores that compute) every slot's two transfers add to it;
- data parallel, as the engine runs it under a pipeline: ddp and zero1 accumulate each micro-batch's gradients
  locally and all-reduce them after the batch's last backward, with nothing left to overlap; fsdp gathers each
  unit for every micro-batch's forward (it stays gathered until that micro-batch's backward), and fsdp and zero2
  reduce-scatter every micro-batch's gradients, behind compute where communication overlaps it; zero1 and zero2
  gather the updated parameters after the step. (FSDP2 under torch's pipelining keeps a stage gathered and its
  gradients unsharded across the micro-batches, and reduces once; this engine does not yet.)

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
from .forecast import Timeline, Topology, optimizer_seconds
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
    per_micro = _per_microbatch_seconds(units, spec, hardware, topology, reduce_itemsize)
    send_s = collective_seconds("send", sent_bytes, 2, p2p_link)
    if hardware.comm_overlaps_compute:  # behind compute but the first gathers, the last reductions, and any excess
        first, last = per_micro
        excess = shape.microbatches * max(0.0, first + last - stage.total)
        line.compute(shape.slots * stage.total + 2 * (shape.size - 1) * send_s + first + last + excess)
    else:  # gloo: every micro-batch's collectives and transfers on the cores that compute
        line.compute(shape.slots * (stage.total + 2 * send_s) + shape.microbatches * sum(per_micro))
    if not spec.shard_gradients:  # ddp, zero1: the gradients accumulated locally, then every bucket all-reduced
        for u in units:
            if u.has_trainable:
                line.issue("all_reduce", _bytes(u, reduce_itemsize), topology.world_size)
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
        comm_s=line.comm_s + shape.slots * 2 * send_s + shape.microbatches * sum(per_micro),
    )


def _per_microbatch_seconds(
    units: list[PlannedUnit], spec: Any, hardware: Hardware, topology: Topology, reduce_itemsize: int | None
) -> tuple[float, float]:
    """The collectives of one micro-batch, (gathers, reductions), as the engine issues them under a pipeline:
    fsdp gathers every unit for its forward (it stays gathered until its backward); fsdp and zero2 reduce-scatter
    each micro-batch's gradients into the shards (hsdp all-reduces the shard across its groups too)."""
    shard, replicas = topology.shard_ranks, topology.world_size // topology.shard_ranks
    link = topology.link_of(shard, hardware)
    gathers = sum(collective_seconds("all_gather", _bytes(u, None), shard, link) for u in units)
    reductions = 0.0
    for u in units:
        if u.has_trainable and spec.shard_gradients:
            reductions += collective_seconds("reduce_scatter", _bytes(u, reduce_itemsize), shard, link)
            across = topology.link_of(topology.world_size, hardware)
            reductions += collective_seconds("all_reduce", _bytes(u, reduce_itemsize) // shard, replicas, across)
    return (gathers if spec.shard_parameters else 0.0), reductions


def _bytes(unit: PlannedUnit, itemsize: int | None) -> int:
    return unit.layout.padded_total * (itemsize or unit.compute_dtype.itemsize)
