"""The memory plan of one pipeline stage (strategies/pipeline_parallel.py): the model state of the rank that holds
the most parameters, and the activations of the micro-batches its schedule keeps in flight.

The stages are cut as the strategy cuts them (pipeline_split.py: the repeated blocks evenly, the modules before
them on the first stage and those after on the last). A micro-batch's activations on a stage are estimated as the
whole model's at the micro-batch's size times the stage's share of the blocks; a schedule keeps up to M of them
in flight under GPipe (every forward before any backward) and up to P under the others (1F1B's warm-up on the
first stage; the interleaved and V-shaped ones hold as many in chunks of half the size).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torch import nn

from ..pipeline_parallel import least_microbatches, stage_ranks, stages_per_rank
from ..pipeline_split import default_split, keep_only, repeated_blocks
from .activations import StepActivations


def rank_modules(meta: nn.Module, size: int, schedule: str) -> dict[int, list[str]]:
    """The modules each pipeline rank holds, its stages cut as the strategy cuts them."""
    stages = stages_per_rank(schedule, None, size) * size
    split = default_split(meta, stages)
    ranks = stage_ranks(schedule, stages, size)
    return {r: [name for s, names in enumerate(split) if ranks[s] == r for name in names] for r in range(size)}


def stage_copy(meta: nn.Module, held: list[str]) -> tuple[nn.Module, float]:
    """A meta copy of `meta` holding the modules `held` only, and its share of the repeated blocks."""
    blocks_name = repeated_blocks(meta)
    blocks = sum(1 for name in held if name.startswith(blocks_name + "."))
    trainer = getattr(meta, "_trainer", None)  # (a TrainModule's, shared as meta_copy shares it: not copied)
    stage = copy.deepcopy(meta, {id(trainer): trainer} if trainer is not None else None)
    keep_only(stage, held)
    return stage, blocks / len(meta.get_submodule(blocks_name))


def largest_stage(meta: nn.Module, size: int, schedule: str) -> tuple[nn.Module, float]:
    """A meta copy of `meta` holding the stages of the pipeline rank with the most parameters, and its share of
    the repeated blocks."""
    held = rank_modules(meta, size, schedule)
    modules = dict(meta.named_modules())
    count = {r: sum(p.numel() for name in names for p in modules[name].parameters()) for r, names in held.items()}
    return stage_copy(meta, held[max(count, key=count.get)])


def in_flight(schedule: str, size: int, microbatches: int) -> int:
    """The micro-batches whose activations a stage holds at once (at most)."""
    return microbatches if schedule == "GPipe" else min(size, microbatches)


def check_microbatches(schedule: str, size: int, microbatches: int | None, batch_size: int) -> int:
    """The micro-batches (None: one per stage), checked as the strategy checks them."""
    stages = stages_per_rank(schedule, None, size) * size
    microbatches = stages if microbatches is None else microbatches
    least = least_microbatches(schedule, size, stages)
    if microbatches < least or batch_size % microbatches:
        raise ValueError(
            f"pipeline_microbatches={microbatches}: pipeline_schedule={schedule!r} over {stages} stages needs at "
            f"least {least}, and batch_size={batch_size} must divide into them"
        )
    return microbatches


def stage_activations(step: StepActivations, share: float, held: int) -> StepActivations:
    """One micro-batch's step on the whole model (`step`) as a stage holds it: `share` of it, `held` at once; what
    is alive beyond the saved tensors is one micro-batch's."""
    saved = int(step.saved * share * held)
    temporaries = int(step.temporaries * share)
    return replace(step, saved=saved, live=saved + temporaries, segment_peaks=(), gradient_order=())
