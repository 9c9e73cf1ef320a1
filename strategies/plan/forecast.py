"""The step-time forecast: one training step of each strategy replayed on two clocks, compute and communication.

Compute is the roofline time of every op (compute.py), kept per module in forward order. Communication is the
collectives the engine issues for the units or buckets `plan_units` lays out at the planned world size (sizes,
dtypes, order), each timed on a link (link.py) and queued on one communication stream as the engine queues them:

- fsdp / hsdp: the root unit is gathered first and kept; every other unit is all-gathered before its forward (the
  next one, and any small units before it, prefetched when a unit starts computing), again before its backward
  (resharded after forward; the last unit of forward stays gathered), and its gradients reduce-scattered when its
  backward ends, small units' together, at most one reduction in flight (the engine waits for the oldest).
  hsdp gathers and reduce-scatters within its shard group and all-reduces the shard across the groups.
- ddp / zero1: each gradient bucket is all-reduced as soon as backward has produced all its gradients;
  zero2 reduce-scatters it instead (one in flight). zero1 and zero2 all-gather the updated parameters after the
  optimizer step, with nothing left to overlap.

The step ends when the optimizer has stepped this rank's elements (a memory-bound pass over parameters, gradients
and state). `exposed_comm_s` is the step minus its compute: the time compute waited for a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..sharding.engine import REDUCE_TOGETHER_BYTES, REDUCTIONS_IN_FLIGHT
from ..sharding.hooks import SMALL_UNIT_FRACTION
from .compute import ComputeCost
from .hardware import Hardware
from .link import collective_seconds
from .report import StepForecast

if TYPE_CHECKING:
    from .model_bytes import PlannedUnit


@dataclass(frozen=True)
class Topology:
    """Where the ranks are: `world_size` ranks, `nodes` machines; fsdp shards over `shard_ranks` of them."""

    world_size: int
    nodes: int
    shard_ranks: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def link_of(self, ranks: int, hardware: Hardware):
        """Groups of consecutive ranks stay on one node while they fit in it."""
        return hardware.intra_node if ranks <= self.ranks_per_node else hardware.inter_node


class Timeline:
    """A compute clock and the communication streams: one, as the engine queues every collective of a process
    group on one NCCL stream, or two (gathers and reductions apart, as torch's fully_shard runs them)."""

    def __init__(self, hardware: Hardware, topology: Topology, streams: int = 1) -> None:
        self.hardware, self.topology = hardware, topology
        self.now = 0.0  # compute
        self.free = {"gather": 0.0, "reduce": 0.0} if streams == 2 else {"gather": 0.0}
        self.comm_s = 0.0

    @property
    def stream_free(self) -> float:
        return max(self.free.values())

    def issue(self, kind: str, nbytes: int, ranks: int, at: float | None = None) -> float:
        """Queue a collective no earlier than `at` (default: now); returns when it ends."""
        seconds = collective_seconds(kind, nbytes, ranks, self.topology.link_of(ranks, self.hardware))
        stream = "gather" if kind == "all_gather" or "reduce" not in self.free else "reduce"
        start = max(self.free[stream], self.now if at is None else at)
        self.free[stream] = start + seconds
        self.comm_s += seconds
        if not self.hardware.comm_overlaps_compute:  # the cores that compute carry it: compute waits
            self.now = max(self.now, self.free[stream])
        return self.free[stream]

    def compute(self, seconds: float, ready: float = 0.0) -> None:
        self.now = max(self.now, ready) + seconds


def unit_of(owner: str, unit_names: list[str]) -> str:
    """The unit a module's parameters belong to: the innermost unit module containing it, else the root ("")."""
    best = ""
    for name in unit_names:
        if name and (owner == name or owner.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


def backward_segments(cost: ComputeCost) -> list[tuple[str, float]]:
    """Backward as the forward reversed, each module's share in proportion to its forward time."""
    total = cost.forward_total or 1.0
    return [(owner, cost.backward * seconds / total) for owner, seconds in reversed(cost.forward)]


def prefetch_window(sequence: list[str], start: int, by_name: dict[str, PlannedUnit]) -> list[str]:
    """The units the engine gathers ahead from `start`: up to and including the first that is not small (a
    normalization unit of a few thousand elements would otherwise be all the look-ahead there is)."""
    largest = max(u.layout.padded_total for u in by_name.values())
    window = []
    for name in sequence[start:]:
        window.append(name)
        if by_name[name].layout.padded_total >= SMALL_UNIT_FRACTION * largest:
            break
    return window


class Reductions:
    """Sharded-gradient reductions as the engine starts them: consecutive units gathered until they hold
    REDUCE_TOGETHER_BYTES, then sent as one collective; once more than REDUCTIONS_IN_FLIGHT are in flight, compute
    waits for the oldest (so that its full-size gradients are freed during backward)."""

    def __init__(self, line: Timeline, kind: str, ranks: int) -> None:
        self.line, self.kind, self.ranks = line, kind, ranks
        self.gathering = 0  # bytes waiting to be sent together
        self.in_flight: list[float] = []  # when each launched reduction ends, oldest first

    def ready(self, nbytes: int) -> None:
        self.gathering += nbytes
        if self.gathering >= REDUCE_TOGETHER_BYTES:
            self.launch()

    def launch(self) -> None:
        if not self.gathering:
            return
        self.in_flight.append(self.line.issue(self.kind, self.gathering, self.ranks))
        self.gathering = 0
        if len(self.in_flight) > REDUCTIONS_IN_FLIGHT:
            self.line.now = max(self.line.now, self.in_flight.pop(0))


def _sharded_step(
    line: Timeline, cost: ComputeCost, units: list[PlannedUnit], hybrid_replicas: int, reduce_itemsize: int | None
) -> None:
    names = [u.name for u in units]
    by_name = {u.name: u for u in units}
    shard = line.topology.shard_ranks

    def gather_bytes(u: PlannedUnit) -> int:
        return u.layout.padded_total * u.compute_dtype.itemsize

    def reduce_bytes(u: PlannedUnit) -> int:
        return u.layout.padded_total * (reduce_itemsize or u.compute_dtype.itemsize) * u.has_trainable

    reductions = Reductions(line, "reduce_scatter", shard)

    def reduce(u: PlannedUnit) -> None:
        reductions.ready(reduce_bytes(u))
        if hybrid_replicas > 1:  # the shard's all-reduce across the groups follows on the same stream
            line.issue("all_reduce", reduce_bytes(u) // shard, hybrid_replicas)

    forward = [(unit_of(owner, names), s) for owner, s in cost.forward]
    backward = [(unit_of(owner, names), s) for owner, s in backward_segments(cost)]
    order = [u for u in dict.fromkeys(["", *(u for u, _ in forward)]) if u in by_name]  # root gathered first
    ready: dict[str, float] = {} if "" in by_name else {"": 0.0}  # no root unit: nothing to gather for it
    for phase, segments in (("forward", forward), ("backward", backward)):
        sequence = order if phase == "forward" else [u for u in reversed(order) if u != ""]
        if phase == "backward":  # the root and the last unit of forward stay gathered; the others were resharded
            ready = {name: ready[name] for name in ("", order[-1]) if name in ready}
        if sequence and sequence[0] not in ready:
            ready[sequence[0]] = line.issue("all_gather", gather_bytes(by_name[sequence[0]]), shard)
        last_segment = {u: i for i, (u, _) in enumerate(segments)}
        started: set[str] = set()
        for i, (unit, seconds) in enumerate(segments):
            if unit not in ready:
                ready[unit] = line.issue("all_gather", gather_bytes(by_name[unit]), shard)
            if unit not in started and unit in sequence:  # prefetch the next units when this one starts
                started.add(unit)
                for nxt in prefetch_window(sequence, sequence.index(unit) + 1, by_name):
                    if nxt not in ready:
                        ready[nxt] = line.issue(
                            "all_gather", gather_bytes(by_name[nxt]), shard, at=max(line.now, ready[unit])
                        )
            line.compute(seconds, ready[unit])
            if phase == "backward" and unit != "" and last_segment[unit] == i:
                reduce(by_name[unit])
    if "" in by_name:
        reduce(by_name[""])
    reductions.launch()


def _bucketed_step(
    line: Timeline,
    cost: ComputeCost,
    units: list[PlannedUnit],
    param_owners: list[list[str]],
    sharded_gradients: bool,
    gather_after_step: bool,
    reduce_itemsize: int | None,
) -> list[int]:
    """ddp, zero1, zero2: buckets reduced as backward completes them. Returns the bytes to gather after the step."""
    world = line.topology.world_size
    done_at: dict[str, float] = {}
    segments = backward_segments(cost)
    # a module's gradients are complete when backward has passed its earliest forward use
    remaining = {owner: sum(1 for o, _ in segments if o == owner) for owner, _ in segments}
    launched = [False] * len(units)
    nbytes_of = [u.layout.padded_total * (reduce_itemsize or u.compute_dtype.itemsize) for u in units]
    reductions = Reductions(line, "reduce_scatter", world)
    for owner, seconds in segments:
        line.compute(seconds)
        remaining[owner] -= 1
        if remaining[owner] == 0:
            done_at[owner] = line.now
        for b, (unit, owners) in enumerate(zip(units, param_owners)):
            if launched[b] or not unit.has_trainable or any(o not in done_at for o in owners if o in remaining):
                continue
            launched[b] = True
            if sharded_gradients:
                reductions.ready(nbytes_of[b])
            else:
                line.issue("all_reduce", nbytes_of[b], world)
    for b, unit in enumerate(units):  # buckets whose parameters no op touched: reduced at the end
        if not launched[b] and unit.has_trainable:
            if sharded_gradients:
                reductions.ready(nbytes_of[b])
            else:
                line.issue("all_reduce", nbytes_of[b], world)
    reductions.launch()
    return [u.layout.padded_total * u.compute_dtype.itemsize for u in units] if gather_after_step else []


def optimizer_seconds(units: list[PlannedUnit], sharded: bool, states: int, hardware: Hardware) -> float:
    """One pass over this rank's trainable elements: read parameter, gradient and states, write parameter and
    states (a fused or foreach optimizer's traffic, in the master dtype)."""
    elements = sum(u.trainable_elements(0 if sharded else None) for u in units)
    itemsize = max((u.dtype.itemsize for u in units), default=4)
    return elements * (3 + 2 * states) * itemsize / hardware.memory_bandwidth


def forecast_step(
    cost: ComputeCost,
    units: list[PlannedUnit],
    spec: Any,
    hardware: Hardware,
    topology: Topology,
    tokens: int,
    states: int,
    reduce_dtype: torch.dtype | None = None,
    param_owners: list[list[str]] | None = None,
    streams: int = 1,
) -> StepForecast:
    """Replay one step of a strategy (its `spec`, its planned `units`) and time it. `tokens` per rank per step.
    `streams=2` replays torch's fully_shard instead: gathers and reductions on streams of their own."""
    line = Timeline(hardware, topology, streams)
    reduce_itemsize = reduce_dtype.itemsize if reduce_dtype is not None else None
    if spec.shard_parameters:
        replicas = topology.world_size // topology.shard_ranks
        _sharded_step(line, cost, units, replicas, reduce_itemsize)
        gathers: list[int] = []
    else:
        line.compute(cost.forward_total)
        gathers = _bucketed_step(
            line,
            cost,
            units,
            param_owners or [[] for _ in units],
            spec.shard_gradients,
            spec.shard_optimizer_state,
            reduce_itemsize,
        )
    line.now = max(line.now, line.stream_free)
    optimizer_s = optimizer_seconds(units, spec.shard_optimizer_state, states, hardware)
    line.compute(optimizer_s)
    for nbytes in gathers:
        line.issue("all_gather", nbytes, topology.world_size)
    step = max(line.now, line.stream_free)
    compute = cost.total
    return StepForecast(
        step_s=step,
        tokens_per_s_per_rank=tokens / step,
        mfu=cost.model_flops / step / hardware.peak(cost.compute_dtype),
        exposed_comm_s=max(0.0, step - compute - optimizer_s),
        compute_s=compute,
        optimizer_s=optimizer_s,
        comm_s=line.comm_s,
    )
