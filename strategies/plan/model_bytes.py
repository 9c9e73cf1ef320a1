"""Model-state bytes per rank, laid out by the engine's own code: the units (fsdp) or gradient buckets (ddp, zero1,
zero2) that set-up would build, each a FlatLayout padded for the ranks it is sharded over.

Bytes per parameter element, with P parameters sharded over N ranks (padding aside), for an optimizer keeping K
state tensors per parameter (Adam: 2) in the master dtype m (the parameters' own, fp32 unless "bf16-true"):

| strategy | parameters | gradients | optimizer |
|---|---|---|---|
| ddp   | m P        | m P       | K m P     |
| zero1 | m P        | m P       | K m P / N |
| zero2 | m P        | m P / N   | K m P / N |
| fsdp  | m P / N    | m P / N   | K m P / N |

With a param dtype p (MixedPrecision(param_dtype=...)) and reduce dtype r (default p), as the engine runs it:
zero1 and zero2 hold replicated parameters in p, and the optimizer holds this rank's fp32 master slice besides its
state, (1 + K) m P / N, as in the ZeRO paper (Rajbhandari et al. 2019). Gradients: zero1 keeps its bucket in p
plus the slice its optimizer reads in m, p P + m P / N; zero2 reduces into a shard in m, m P / N (the paper counts
r P / N: the optimizer needs gradients in the master's dtype, so the engine keeps them so rather than converting
at each step). fsdp keeps one master shard m P / N that is both the parameters and the master copy (the gathered
copy is cast to p) and its gradient shard in m. So mixed-precision Adam costs (2 + 2 + 12) P / N under fsdp, as in
the paper, and zero1 / zero2 hold 2 P / N more than the paper's figures (1.5% at its 7.5B on 64 ranks). ddp with a
param dtype (the engine refuses it: mixed precision needs a sharded master) is planned as the paper has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..sharding import ShardingSpec
from ..sharding.layout import FlatLayout
from ..sharding.unit import assign_to_units, full_precision_norm_units, gradient_buckets, policy_modules
from ..sharding.whole_tensors import assign_owners
from ..wrap import resolve_wrap_policy
from .activations import StepActivations
from .report import StrategyMemory

# State tensors the size of the parameter that each optimizer keeps (scalars such as Adam's step aside).
OPTIMIZER_STATES: dict[str, int] = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "adamax": 2,
    "nadam": 2,
    "radam": 2,
    "adadelta": 2,  # square_avg, acc_delta
    "sgd-momentum": 1,  # momentum_buffer
    "adagrad": 1,  # sum
    "rmsprop": 1,  # square_avg (one more with momentum, one more if centered)
    "sgd": 0,
    "lion": 1,  # exp_avg (pytorch-optimizer's)
    "muon": 1,  # momentum_buffer
    "lamb": 2,  # exp_avg, exp_avg_sq (pytorch-optimizer's)
    "adafactor": 1,  # variance of a vector; a matrix keeps a row and a column instead (FACTORED)
}
# Optimizers whose step reads whole tensors (strategies/sharding/step_kind.py): under sharded optimizer state each
# rank steps the whole parameters it owns (whole_tensors.py), keeping their state, and holds during the step a whole
# value and gradient of each, and the pieces they were laid out from (WHOLE_STEP_COPIES).
WHOLE_TENSOR_OPTIMIZERS = {"muon", "lamb", "adafactor"}
FACTORED = {"adafactor"}  # a matrix's second moments as one row and one column
WHOLE_STEP_COPIES = 4
# torch's optimizers without foreach step one tensor at a time: Adam's `exp_avg_sq.sqrt() / bias_correction2_sqrt`
# has two tensors of its size alive at once. With foreach (torch's default for CUDA tensors), `_foreach_sqrt` makes
# one tensor the size of every state tensor of a parameter group (per device and dtype) before it is used.
SINGLE_TENSOR_TEMPORARIES = 2
FOREACH_TEMPORARIES = 1
PREFETCHED_UNITS = 2  # fsdp: the unit computing and the next one, gathered ahead
UNREDUCED_BUCKETS = 2  # zero2: the bucket being filled and the one whose reduce-scatter is in flight


def check_optimizer(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not known to the plan; choose one of {list(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The OPTIMIZER_STATES key of a torch optimizer."""
    name = type(optimizer).__name__.lower()
    if name == "sgd" and optimizer.defaults.get("momentum", 0):
        return "sgd-momentum"
    check_optimizer(name)
    return name


@dataclass(frozen=True)
class PlannedUnit:
    """One unit or bucket as the engine would build it."""

    name: str  # "" for the fsdp root
    layout: FlatLayout
    trainable: tuple[bool, ...]
    dtype: torch.dtype  # of the master weights: the parameters' own
    compute_dtype: torch.dtype  # of the gathered parameters and their gradients
    param_names: tuple[str, ...] = ()

    @property
    def has_trainable(self) -> bool:
        return any(self.trainable)

    def trainable_elements(self, rank: int | None = None) -> int:
        """Trainable elements in all (rank None) or in the pieces `rank` owns."""
        if rank is None:
            return sum(n for n, t in zip(self.layout.numels, self.trainable) if t)
        return sum(piece.numel for piece in self.layout.pieces(rank) if self.trainable[piece.param_index])


def plan_units(
    model: nn.Module,
    spec: ShardingSpec,
    world_size: int,
    wrap_policy: Any = None,
    param_dtype: torch.dtype | None = None,
    full_precision_norms: bool = True,
) -> list[PlannedUnit]:
    """The units of `model` under `spec`, as ShardingEngine._build_units groups them, laid out for `world_size`
    (`full_precision_norms=False`: as torch's fully_shard would, normalization layers cast like the rest)."""
    norm_units: set[str] = set()
    if spec.shard_parameters:
        chosen = [name for name, _ in policy_modules(model, resolve_wrap_policy(wrap_policy))]
        if param_dtype is not None and full_precision_norms:  # the engine keeps norms in full precision, as units
            norm_units = full_precision_norm_units(model, set(chosen))
        wrapped = [name for name, _ in model.named_modules() if name in set(chosen) | norm_units]
        assigned = assign_to_units(model, wrapped)
        # in the engine's order, the order backward finishes them in: the last unit of forward first, the root last
        groups = [(name, assigned[name]) for name in reversed(wrapped)] + [("", assigned[""])]
    else:
        groups = [(f"bucket{i}", bucket) for i, bucket in enumerate(gradient_buckets(model))]
    units = []
    for name, params in groups:
        if params:
            dtype = params[0][1].dtype
            compute = dtype if param_dtype is None or name in norm_units else param_dtype
            trainable = tuple(p.requires_grad for _, p in params)
            layout = FlatLayout([p.shape for _, p in params], world_size, list(trainable))
            units.append(PlannedUnit(name, layout, trainable, dtype, compute, tuple(n for n, _ in params)))
    return units


def _unit_bytes(
    unit: PlannedUnit, spec: ShardingSpec, rank: int, states: int, reduce_dtype: torch.dtype | None
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes of one unit on `rank`; see the module's table."""
    layout, master = unit.layout, unit.dtype.itemsize
    owned = unit.trainable_elements(rank if spec.shard_optimizer_state else None)
    grad_elements = layout.trainable_shard_size if spec.shard_gradients else layout.padded_total * unit.has_trainable
    if spec.shard_parameters:
        return layout.shard_size * master, grad_elements * master, states * owned * master
    if unit.compute_dtype == unit.dtype:
        return layout.padded_total * master, grad_elements * master, states * owned * master
    reduce = (reduce_dtype or unit.compute_dtype).itemsize
    own = layout.shard_size if spec.shard_optimizer_state else layout.padded_total  # elements this rank steps
    if spec.shard_gradients:
        gradients = own * master * unit.has_trainable
    elif spec.shard_optimizer_state:  # the bucket, and the slice the optimizer reads in the master's dtype
        gradients = (layout.padded_total * reduce + own * master) * unit.has_trainable
    else:  # ddp: the engine does not run it with a param dtype; as the paper describes it
        gradients = layout.padded_total * reduce * unit.has_trainable
    optimizer = own * master + states * owned * master  # the master copy, the states
    return layout.padded_total * unit.compute_dtype.itemsize, gradients, optimizer


def units_in_flight(
    units: list[PlannedUnit], spec: ShardingSpec, step: StepActivations | None = None, keep_gathered: bool = False
) -> int:
    """Unsharded buffers that exist only during the step. fsdp: the root's gathered parameters (held for the whole
    step), the two largest other units' (one computing, one prefetched), and the unreduced gradients. zero2: the
    unreduced gradients. ddp and zero1: none (gradients go straight into their buckets). Unreduced gradients
    (autograd's .grad until the reduce-scatter sends them): with the pass's timeline (`step`), what they add to
    its peak (gradients_in_flight); without it, one unit's (fsdp) or the two largest buckets' (zero2)."""
    full = {id(u): u.layout.padded_total * u.compute_dtype.itemsize for u in units}
    grads = [_unreduced_bytes(u) for u in units if u.has_trainable]  # autograd's .grad of the trainable parameters
    if step is not None and step.gradient_order and spec.shard_gradients:
        unreduced = gradients_in_flight(units, step)
    else:
        unreduced = max(grads, default=0) if spec.shard_parameters else sum(sorted(grads)[-UNREDUCED_BUCKETS:])
    if spec.shard_parameters and keep_gathered:
        return sum(full.values()) + unreduced
    if spec.shard_parameters:
        root = sum(full[id(u)] for u in units if u.name == "")
        others = sorted((full[id(u)] for u in units if u.name != ""), reverse=True)[:PREFETCHED_UNITS]
        return root + sum(others) + unreduced
    if spec.shard_gradients:
        return unreduced
    return 0


def _unreduced_bytes(unit: PlannedUnit) -> int:
    return unit.layout.trainable_shard_size * unit.layout.world_size * unit.compute_dtype.itemsize


def gradients_in_flight(units: list[PlannedUnit], step: StepActivations) -> int:
    """What sharded gradients add to the peak of forward and backward, replayed on the pass's timeline as the
    engine reduces them: a unit's reduce-scatter starts once all its gradients have come and every unit before
    it in the engine's order has started; when one starts, the one before it finishes (REDUCTIONS_IN_FLIGHT = 1),
    freeing its full-size gradients and keeping this rank's shard. At each moment the unreduced gradients and
    the shards so far add to what the pass holds then; the result is the new peak less the pass's own."""
    order = [u for u in units if u.has_trainable]
    unit_of, grad_bytes = {}, {}
    for index, unit in enumerate(order):
        for name, numel, trainable in zip(unit.param_names, unit.layout.numels, unit.trainable):
            if trainable:
                unit_of[name], grad_bytes[name] = index, numel * unit.compute_dtype.itemsize
    remaining = [sum(u.trainable) for u in order]
    unreduced = [0] * len(order)
    shard = [u.layout.trainable_shard_size * u.dtype.itemsize for u in order]
    finished: set[int] = set()
    launched = 0
    peak = step.segment_peaks[0]
    for name, after in zip(step.gradient_order, step.segment_peaks[1:]):
        if name not in unit_of:
            continue
        index = unit_of[name]
        unreduced[index] += grad_bytes[name]
        remaining[index] -= 1
        while launched < len(order) and remaining[launched] <= 0:
            launched += 1
            if launched > 1:
                finished.add(launched - 2)
        held = sum(shard[i] if i in finished else unreduced[i] for i in range(len(order)))
        peak = max(peak, after + held)
    return max(0, peak - max(step.segment_peaks))


def state_elements(optimizer: str, shape: torch.Size) -> int:
    """Elements of the state `optimizer` keeps for a whole parameter of `shape`."""
    if optimizer in FACTORED and len(shape) >= 2:
        return shape.numel() // shape[-1] + shape.numel() // shape[-2]  # a row and a column
    return OPTIMIZER_STATES[optimizer] * shape.numel()


def whole_tensor_steps(
    units: list[PlannedUnit], spec: ShardingSpec, world_size: int, optimizer: str
) -> list[tuple[int, int]]:
    """Per rank, for an optimizer that steps whole tensors: (bytes of its state, elements it steps whole), with
    each trainable parameter owned as the engine owns it (whole_tensors.assign_owners); every rank steps every
    parameter without sharded optimizer state."""
    params = [(u.layout.shapes[i], u.dtype.itemsize) for u in units for i, t in enumerate(u.trainable) if t]
    if spec.shard_optimizer_state:
        owners = assign_owners([shape.numel() for shape, _ in params], world_size)
    else:
        owners = [None] * len(params)
    out = []
    for rank in range(world_size):
        mine = [(shape, size) for (shape, size), owner in zip(params, owners) if owner in (rank, None)]
        out.append((sum(state_elements(optimizer, s) * size for s, size in mine), sum(s.numel() for s, _ in mine)))
    return out


def optimizer_step_temporaries(
    units: list[PlannedUnit], spec: ShardingSpec, world_size: int, states: int, foreach: bool
) -> int:
    """Bytes the optimizer's step makes and frees on the rank with the most: with foreach, one tensor the size of
    all it steps (the plan does not know the parameter groups: one group, the most it can be); without, two
    of the largest tensor it steps (a parameter, or this rank's piece of one under sharded optimizer state)."""
    if states == 0:
        return 0
    sizes = []  # (elements, itemsize) of each tensor the optimizer steps, on the rank with the most
    for unit in units:
        if spec.shard_optimizer_state:
            by_rank = (list(unit.layout.pieces(r)) for r in range(world_size))
            pieces = max(by_rank, key=lambda ps: sum(p.numel for p in ps))
            sizes += [(p.numel, unit.dtype.itemsize) for p in pieces if unit.trainable[p.param_index]]
        else:
            sizes += [(n, unit.dtype.itemsize) for n, t in zip(unit.layout.numels, unit.trainable) if t]
    if foreach:
        return FOREACH_TEMPORARIES * sum(n * size for n, size in sizes)
    return SINGLE_TENSOR_TEMPORARIES * max((n * size for n, size in sizes), default=0)


def model_state_bytes(
    model: nn.Module,
    spec: ShardingSpec,
    world_size: int,
    rank: int | None = None,
    wrap_policy: Any = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    foreach: bool | None = None,
    step: StepActivations | None = None,
    keep_gathered: bool = False,
) -> StrategyMemory:
    """Bytes on `rank` (default: the rank that holds the most) with state sharded over `world_size` ranks
    (a hybrid layout would pass its shard group's size). Reads only shapes, dtypes and requires_grad: `model`
    may live on the meta device. `activations` and `temporaries` are left 0. `foreach`: whether the optimizer
    steps with torch's foreach kernels (default: as torch chooses here, for CUDA tensors). `step`: the timeline
    of the pass activations.py makes, by which sharded gradients are counted as the engine holds them.
    `keep_gathered`: fsdp's units stay gathered from forward to backward (reshard_after_forward=False, the default
    under a pipeline): every unit's full parameters are in flight."""
    states = check_optimizer(optimizer)
    if param_dtype is not None and param_dtype == next(model.parameters()).dtype:
        param_dtype = None  # nothing to cast: no separate master copy
    units = plan_units(model, spec, world_size, wrap_policy, param_dtype)
    ranks = range(world_size) if rank is None else [rank]
    whole = optimizer in WHOLE_TENSOR_OPTIMIZERS
    piece_states = 0 if whole else states  # (whole-tensor state is counted per owner below)
    per_rank = [
        [sum(b) for b in zip(*(_unit_bytes(u, spec, r, piece_states, reduce_dtype) for u in units))] for r in ranks
    ]
    if whole:
        owned = whole_tensor_steps(units, spec, world_size, optimizer)
        per_rank = [[p, g, o + owned[r][0]] for r, (p, g, o) in zip(ranks, per_rank)]
    parameters, gradients, optimizer_bytes = max(per_rank, key=sum)
    foreach = torch.cuda.is_available() if foreach is None else foreach
    if whole and spec.shard_optimizer_state:  # the whole tensors a rank steps, and the pieces they came from
        master = max((u.dtype.itemsize for u in units), default=4)
        step_bytes = WHOLE_STEP_COPIES * max(elements for _, elements in owned) * master
    else:
        step_bytes = optimizer_step_temporaries(units, spec, world_size, states, foreach)
    return StrategyMemory(
        parameters,
        gradients,
        optimizer_bytes,
        units_in_flight(units, spec, step, keep_gathered),
        0,
        gradients_between_steps=not spec.shard_gradients,
        optimizer_step=step_bytes,
    )
