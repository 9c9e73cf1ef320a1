"""The steps of an evaluation on every rank: each sample reaches the user's step once, and no rank waits forever.

Every rank must run the same steps: under fsdp each forward pass all-gathers parameters from every rank, and a value
logged with `sync_dist` on a step all-reduces. A split dataset with a length gives every rank as many batches
(data.ShardBatchSampler), so the ranks run out together. Where they cannot (batch_size=1 with a remainder, fewer
samples than ranks, `drop_last`, an iterable dataset whose ranks yield different counts), a rank without a batch
does not run the user's step on anything: it takes part in the collectives that the others' step makes, repeating
those of its step before (the unit all-gathers of fsdp, synced logs; strategies/step_trace.py), while the ranks
with a batch check that their step makes exactly those. What cannot be repeated (the step gathers with
`self.all_gather`; no step ran before under fsdp; the steps' collectives differ between ranks) is an error naming
the ranks, on every rank. Rank 0 says once per kind of step when ranks sit out steps.

For a loader without a length the ranks tell each other at every step whether they have a batch (one all-reduce);
for other loaders every rank knows every rank's count from the start.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strategies.step_trace import Collective, StepMismatch, first_unrepeatable

from ..data.loaders import batches_per_rank, loader_length
from ..loop.agreement import count_across_ranks

if TYPE_CHECKING:
    from ..trainer import Trainer

_END = object()
STEP_NAMES = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


@dataclass
class StepMemory:
    """Per Trainer: the collectives of the latest step of each stage on this rank, and the stages whose ranks
    sat out steps already (said once)."""

    traces: dict[str, list[Collective]] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)


def run_steps(trainer: Trainer, loader: Any, limit: int, stage: str, step: Callable[[Any, int], None]) -> bool:
    """Call `step(batch, batch_idx)` on each of this rank's batches (at most `limit` steps on every rank), taking
    part in the others' steps once out of batches. Returns whether some rank sat out a step. Collective."""
    return _Steps(trainer, loader, stage).run(limit, step)


class _Steps:
    def __init__(self, trainer: Trainer, loader: Any, stage: str) -> None:
        self.trainer, self.strategy, self.loader, self.stage = trainer, trainer.strategy, loader, stage
        self.memory: StepMemory = trainer.step_memory
        self.step_name = STEP_NAMES[stage]
        self.agreed: list[Collective] | None = None  # what the ranks without a batch repeat, once some have none
        self.lacking: list[int] = []  # the ranks without a batch when that was agreed

    def run(self, limit: int, step: Callable[[Any, int], None]) -> bool:
        world = self.strategy.world_size
        counts = self._counts()
        steps = min(limit, max(counts)) if counts is not None else limit
        iterator, exhausted = iter(self.loader), False
        for index in range(steps):
            batch = _END
            if not exhausted and (counts is None or index < counts[self.strategy.global_rank]):
                batch = next(iterator, _END)
                exhausted = batch is _END
            has_batch = batch is not _END
            having = self._count_having(has_batch, index, counts)
            if having == 0:
                break
            if having < world and self.agreed is None:
                self.lacking = self._lacking(has_batch, index, counts)
                self.agreed = self._agree(index)
            mismatch = None
            if has_batch:
                mismatch = self._run(step, batch, index, expected=self.agreed if having < world else None)
            else:
                self.strategy.repeat(self.agreed)
            if having < world:
                self._stop_on_mismatch(mismatch)
        return self.agreed is not None

    def _counts(self) -> list[int] | None:
        """Every rank's number of batches, when the loaders have a length; None otherwise. Collective."""
        counts = batches_per_rank(self.loader)  # by data-parallel rank
        if counts is not None:  # the ranks of a tensor- or context-parallel group read the same batches
            return [counts[self.strategy.data_parallel_rank_of(rank)] for rank in range(self.strategy.world_size)]
        if not self.strategy.distributed:
            return counts
        length = None if _is_iterable(self.loader) else loader_length(self.loader)
        lengths = self.strategy.all_gather_object(length)
        return None if any(n is None for n in lengths) else lengths

    def _count_having(self, has_batch: bool, index: int, counts: list[int] | None) -> int:
        """How many ranks have a batch for this step: known from the counts, or told in one all-reduce."""
        if counts is not None:
            return sum(index < n for n in counts)
        if not self.strategy.distributed:
            return int(has_batch)
        return count_across_ranks(self.strategy, (has_batch,))[0]

    def _lacking(self, has_batch: bool, index: int, counts: list[int] | None) -> list[int]:
        """The ranks without a batch for this step. Collective when the counts are not known."""
        if counts is not None:
            return [rank for rank, n in enumerate(counts) if index >= n]
        return [rank for rank, flag in enumerate(self.strategy.all_gather_object(has_batch)) if not flag]

    def _run(self, step: Callable[[Any, int], None], batch: Any, index: int, expected: list | None) -> str | None:
        """One step of this rank, its collectives traced. With `expected` (the ranks without a batch repeat those),
        a step that makes other collectives is stopped before the first that differs; this rank then takes part in
        the rest of `expected`, so that no rank waits, and what went wrong is returned."""
        if not self.strategy.distributed:
            step(batch, index)
            return None
        try:
            with self.strategy.tracing(expected) as trace:
                step(batch, index)
        except StepMismatch as mismatch:
            self.strategy.repeat(expected[len(trace.collectives) :])
            return f"{self.step_name} {index} on rank {self.strategy.global_rank}: {mismatch}"
        self.memory.traces[self.stage] = trace.collectives
        return None

    def _stop_on_mismatch(self, mismatch: str | None) -> None:
        """After a step that some ranks sat out: every rank raises if any rank's step differed. Collective."""
        if not count_across_ranks(self.strategy, (mismatch is not None,))[0]:
            return
        first = next(m for m in self.strategy.all_gather_object(mismatch) if m is not None)
        raise RuntimeError(
            f"{first}. Rank(s) {self.lacking} have no batch for this step and repeat the collectives of the step "
            f"before, so the collectives of {self.step_name} must not depend on its data"
        )

    def _agree(self, index: int) -> list[Collective]:
        """The collectives the ranks without a batch repeat from now on: those of the latest step, the same on
        every rank that ran one. Collective; raises the same error on every rank where there is no such thing."""
        offered = self.strategy.all_gather_object(self.memory.traces.get(self.stage))
        known = [(rank, trace) for rank, trace in enumerate(offered) if trace is not None]
        where = f"rank(s) {self.lacking} have no batch for {self.step_name} {index}"
        differing = [rank for rank, trace in known if trace != known[0][1]]
        if differing:
            raise RuntimeError(
                f"{where}, so they repeat the collectives of the step before; but {self.step_name} made different "
                f"collectives on rank {known[0][0]} and rank(s) {differing}: they must not depend on the data"
            )
        agreed = known[0][1] if known else []
        if not known and self.strategy.forward_gathers:
            raise RuntimeError(
                f"{where}, and no {self.step_name} ran before whose all-gathers they could repeat (under fsdp every "
                "forward pass needs every rank). Give every rank at least one batch: an iterable dataset should "
                "yield on every rank, and a dataset with a length have at least as many samples as ranks"
            )
        self._check_repeatable(where, agreed)
        self._say_once(index)
        return agreed

    def _check_repeatable(self, where: str, agreed: list[Collective]) -> None:
        unrepeatable = first_unrepeatable(agreed)
        if unrepeatable is not None:
            raise RuntimeError(
                f"{where}, and {self.step_name} makes {unrepeatable.describe()}, which they cannot take part in "
                "without running the step. Give every rank as many batches, or make that collective at the epoch's "
                "end (on_validation_epoch_end, ...)"
            )
        synced = [name for name, m in self.trainer.module.named_modules() if getattr(m, "dist_sync_on_step", False)]
        if synced:
            raise RuntimeError(
                f"{where}, and the metric(s) {synced} sync on every step (dist_sync_on_step=True), which those ranks "
                "cannot take part in without running the step. Leave dist_sync_on_step=False (the metric syncs in "
                "compute() at the epoch's end), or give every rank as many batches"
            )

    def _say_once(self, index: int) -> None:
        if self.stage in self.memory.said:
            return
        self.memory.said.add(self.stage)
        if self.strategy.is_global_zero:
            warnings.warn(
                f"{self.step_name}: rank(s) {self.lacking} have no batch left at step {index} while other ranks do; "
                f"in the remaining steps they take part in the collectives of each step without running "
                f"{self.step_name}, so every sample is still seen once. Giving every rank as many batches avoids "
                "the wait (said once per Trainer)",
                stacklevel=2,
            )


def _is_iterable(loader: Any) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(getattr(loader, "dataset", None), IterableDataset)
