"""Bytes the engine holds on this rank, by kind (invariant 2 in docs/architecture.md)."""

from __future__ import annotations

import resource

from .engine import ShardingEngine
from .unit import ParamState


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_report(engine: ShardingEngine) -> dict[str, int]:
    """Per-rank bytes: parameters, gradients (sharded ones at the size they have from backward to zero_grad),
    optimizer state, unsharded buffers in flight, padding, and the process's peak resident memory (an
    independent measurement); and `trainable_elements`, the trainable parameter elements this rank's optimizer
    steps (its share of them when optimizer state is sharded)."""
    report = dict.fromkeys(["parameters", "gradients", "unsharded_in_flight", "padding"], 0)
    for unit in engine.units:
        pad = unit.layout.padding * unit.full_flat.element_size()
        if engine.spec.shard_parameters:
            report["parameters"] += _nbytes(unit.master)
            if unit.state is not ParamState.SHARDED:
                report["unsharded_in_flight"] += unit.full_flat.untyped_storage().nbytes()
            pad //= engine.world_size
        else:
            report["parameters"] += _nbytes(unit.full_flat)
        # A sharded gradient exists from the first reduction of a step until zero_grad; counted at that size.
        report["gradients"] += unit.grads.nbytes
        report["padding"] += pad
    # ZeRO counts the full-precision master copy of mixed precision among the optimizer states (its K = 12).
    masters = sum(
        _nbytes(u.master) for u in engine.units if not engine.spec.shard_parameters and not u.master_is_in_full_flat
    )
    report["optimizer_state"] = engine.optimizer_state_bytes + masters
    report["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["trainable_elements"] = trainable_elements(engine)
    return report


def trainable_elements(engine: ShardingEngine) -> int:
    """Trainable parameter elements this rank steps: its pieces of them under sharded optimizer state."""
    if engine.spec.shard_optimizer_state:
        return sum(piece.numel for unit in engine.units for piece in unit.pieces if unit.trainable[piece.param_index])
    return sum(n for unit in engine.units for n, t in zip(unit.layout.numels, unit.trainable) if t)


def parameter_bytes(engine: ShardingEngine) -> dict[str, int]:
    """Bytes of each parameter (by its first name) that this rank holds between steps: its pieces of the master
    under fsdp, the whole parameter otherwise."""
    out = {}
    for unit in engine.units:
        for index, name in enumerate(unit.param_names):
            if engine.spec.shard_parameters:
                elements = sum(p.numel for p in unit.pieces if p.param_index == index)
                out[name] = elements * unit.master.element_size()
            else:
                out[name] = unit.layout.numels[index] * unit.full_flat.element_size()
    return out
