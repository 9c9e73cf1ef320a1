"""The global batch (samples per optimizer step over all data-parallel ranks) as part of the experiment, and where
an epoch resumes when a run continues on another number of ranks.

`Trainer(global_batch_size=G)` derives the gradient accumulation from G, the loader's batch size and the ranks, so
a run resumed on fewer or more ranks steps the optimizer on batches of G samples as before. A checkpoint records
how its epoch was split (`DataLayout`); a resume on another layout converts the position in the epoch:

- The Trainer's sampler deals one permutation of the epoch (the seed's and the epoch's, the same at every world
  size) out to the ranks in turn, so its first `k` batches on every rank are the permutation's first
  `k * batch_size * ranks` samples. Skipping the samples trained before the checkpoint then skips exactly those, at
  any world size: the resumed run trains the rest of the epoch in the uninterrupted run's order, each once.
- LitData's `StreamingDataLoader` keeps the stream's global position in its state and resumes it on any number of
  ranks itself (its elastic resume); the Trainer gives every new rank an old rank's state.
- Any other stream (an iterable dataset, or a loader with a sampler of the user's) is split by the stream itself: its
  state or its batch count on one number of ranks says nothing of what another split has trained, so a resume on
  another number of ranks in the middle of an epoch is refused, unless `restore_loader_state=False` accepts that
  the epoch is read again and each rank skips as many samples as it would have trained (named in a warning).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

from .loader_state import LOADER_STATE_ARGUMENT, resumes_on_any_world_size
from .stream_check import split_by_the_trainer


@dataclass(frozen=True)
class DataLayout:
    """How a run splits its training epochs: the loader's batch size (per rank), the data-parallel ranks, the
    gradient accumulation, and whether a position in an epoch carries over to another number of ranks (`elastic`:
    the Trainer's sampler, or a loader whose own state resumes anywhere, loader_state.resumes_on_any_world_size)."""

    batch_size: int | None
    ranks: int
    accumulate: int
    elastic: bool

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step over all ranks; None when the loader has no batch size."""
        return None if self.batch_size is None else self.batch_size * self.ranks * self.accumulate

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)


def accumulation_for(global_batch_size: int, batch_size: int | None, ranks: int) -> int:
    """The batches each rank accumulates per optimizer step so that the step sees `global_batch_size` samples."""
    if batch_size is None:
        raise ValueError(
            f"global_batch_size={global_batch_size} needs a training loader with a batch size (DataLoader's "
            "batch_size); this one batches by a batch_sampler of its own: set accumulate_grad_batches instead"
        )
    per_step, remainder = divmod(global_batch_size, batch_size * ranks)
    if remainder or per_step == 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide into batches of {batch_size} (the training "
            f"loader's batch_size) on {ranks} data-parallel rank{'s' * (ranks > 1)}: it must be a multiple of "
            f"{batch_size} x {ranks} = {batch_size * ranks}"
        )
    return per_step


def layout_of(trainer: Any, loader: Any) -> DataLayout:
    """The layout `trainer` trains `loader` with, its accumulation derived from `global_batch_size` if given."""
    batch_size = getattr(loader, "batch_size", None)
    ranks = trainer.strategy.data_parallel_size
    accumulate = trainer.accumulate_grad_batches
    if trainer.global_batch_size is not None:
        accumulate = accumulation_for(trainer.global_batch_size, batch_size, ranks)
    return DataLayout(batch_size, ranks, accumulate, split_by_the_trainer(loader) or resumes_on_any_world_size(loader))


def resumed_batches(saved: DataLayout, now: DataLayout, batches_done: int, restore_loader_state: bool) -> int:
    """The batches each rank of `now` skips in the epoch a checkpoint of layout `saved` stopped in after
    `batches_done` batches per rank; warns where that is not exact, and refuses a stream split another way."""
    if batches_done == 0 or (saved.batch_size, saved.ranks) == (now.batch_size, now.ranks):
        return batches_done
    if None in (saved.batch_size, now.batch_size):
        raise ValueError(
            "the checkpoint stopped in the middle of an epoch of a loader without a batch size, and this run splits "
            f"the data over {now.ranks} ranks where it had {saved.ranks}: where it was in the epoch cannot be found"
        )
    trained = batches_done * saved.batch_size * saved.ranks  # samples, over all ranks
    per_batch = now.batch_size * now.ranks
    skip, repeated = divmod(trained, per_batch)
    if not (saved.elastic and now.elastic) and saved.ranks != now.ranks:
        return _stream_batches(saved, now, trained, skip, restore_loader_state)
    if repeated:
        warnings.warn(
            f"resuming in the middle of an epoch on {now.ranks} ranks with batches of {now.batch_size}: the "
            f"{trained} samples trained before the checkpoint are not a whole number of this run's batches of "
            f"{per_batch} over all ranks, so the first {repeated} of them train again in this epoch",
            stacklevel=4,
        )
    return skip


def _stream_batches(saved: DataLayout, now: DataLayout, trained: int, skip: int, restore_loader_state: bool) -> int:
    if restore_loader_state:
        raise ValueError(
            f"the checkpoint stopped in the middle of an epoch of a stream (an iterable dataset, or a loader with "
            f"a sampler of its own) read by {saved.ranks} ranks, and this run has {now.ranks}: a stream is split "
            f"by the stream itself, so what {saved.ranks} ranks trained of it is not a part of what {now.ranks} "
            f"read. Choose one: resume on {saved.ranks} ranks, resume from a checkpoint at the end of an epoch, or "
            f"pass fit(..., {LOADER_STATE_ARGUMENT}=False) to read this epoch again and skip as many samples as "
            "were trained (some then train twice in this epoch, and as many not at all)"
        )
    warnings.warn(
        f"{LOADER_STATE_ARGUMENT}=False: the {trained} samples of this epoch trained on {saved.ranks} ranks before "
        f"the checkpoint are not the ones skipped now: each of the {now.ranks} ranks reads its part of the stream "
        f"again and skips its first {skip * now.batch_size} samples ({skip * now.batch_size * now.ranks} in all), "
        "so in this epoch some samples train twice and as many not at all",
        stacklevel=4,
    )
    return skip


def warn_if_the_global_batch_changed(saved: DataLayout, now: DataLayout) -> None:
    """Without `global_batch_size`, a resume on another number of ranks changes the samples per optimizer step."""
    if saved.global_batch is None or now.global_batch is None or saved.global_batch == now.global_batch:
        return
    warnings.warn(
        f"the checkpoint's run stepped the optimizer on global batches of {saved.global_batch} samples "
        f"({saved.batch_size} per batch x {saved.ranks} ranks x {saved.accumulate} accumulated) and this run on "
        f"{now.global_batch} ({now.batch_size} x {now.ranks} x {now.accumulate}), against the same schedule: "
        f"pass Trainer(global_batch_size={saved.global_batch}) to keep the experiment's global batch",
        stacklevel=4,
    )
