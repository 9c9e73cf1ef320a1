"""Saving a trainer: every rank's part of the checkpoint (its pieces of the model and optimizer state, its RNG
states; rank 0 also the trainer state and the description), written by strategies.checkpoint's writer (every
rank in parallel, atomically, synchronously or in the background), or as one plain file.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from strategies.checkpoint import files, model_state
from strategies.checkpoint.format import LOADER, META, MODEL, RNG, TRAINER
from strategies.checkpoint.planners import Pickled
from strategies.checkpoint.writer import CheckpointWriter

from ..seed import rng_state
from .trainer_state import callbacks_sharded_state, meta, optimizers, trainer_state

if TYPE_CHECKING:
    from ..trainer import Trainer


def checkpoint_state(trainer: Trainer) -> dict[str, Any]:
    """This rank's nested state dict for DCP: its pieces of the model and optimizer state, its RNG states and, in
    the middle of an epoch, its training loader's own state (where it keeps one); on rank 0 also the buffers, the
    parameter groups, the trainer state and the meta description."""
    state = model_state.pieces(trainer.strategy, MODEL, optimizers(trainer))
    state[RNG] = {str(trainer.global_rank): Pickled(rng_state(), f"{RNG}.{trainer.global_rank}")}
    loader_state = trainer.loader_position.saved() if trainer.state.batches_done_in_epoch else None
    if loader_state is not None:
        state[LOADER] = {str(trainer.global_rank): Pickled(loader_state, f"{LOADER}.{trainer.global_rank}")}
    state.update(callbacks_sharded_state(trainer))  # before the callbacks' state_dict, which may follow it
    if trainer.is_global_zero:
        state[TRAINER], state[META] = Pickled(trainer_state(trainer), TRAINER), Pickled(meta(trainer), META)
    return state


class Saver:
    """A trainer's checkpoint writer, with at most one save in flight. `Trainer.save_checkpoint` and
    `ModelCheckpoint` use the Trainer's own (`trainer.checkpointer`); you rarely need another."""

    def __init__(self) -> None:
        self.writer = CheckpointWriter()
        self.texts: dict[str, str] = {}
        """Text files put in every checkpoint directory (file name to contents), written by rank 0 atomically
        with the checkpoint: the command line (`trainer.cli.CLI`) puts the run's `config.yaml` here."""

    def save(
        self,
        trainer: Trainer,
        path: str | os.PathLike,
        async_save: bool = False,
        links: list[str] = (),
        on_done: Any = None,
    ) -> None:
        """Write a checkpoint directory of `trainer` at `path`, after the save in flight (if any) is complete.
        Collective: every rank calls it.

        Args:
            trainer: the Trainer to save.
            path: the checkpoint directory, replaced only once the new one is complete.
            async_save: return once the state is copied; the files are written in the background.
            links: further paths at which to put the same checkpoint (hard links to its files).
            on_done: called on rank 0 once the checkpoint is complete.
        """
        self.writer.wait()
        summary = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "world_size": trainer.world_size}
        self.writer.save(checkpoint_state(trainer), path, summary, async_save, links, on_done, texts=self.texts)

    def save_full(self, trainer: Trainer, path: str) -> None:
        """Write one plain file at `path` that `torch.load` reads. Collective.

        Every rank saves a checkpoint directory beside it, which rank 0 then consolidates (a batch of tensors at a
        time) and removes.

        Args:
            trainer: the Trainer to save.
            path: the file.

        Raises:
            RuntimeError: on the other ranks, if rank 0 failed to write the file (rank 0 raises its own error).
        """
        from .export import consolidate

        strategy = trainer.strategy
        directory = strategy.broadcast(files.staging_path(os.path.abspath(path)))  # removed by later saves if left
        self.save(trainer, directory)
        error = None
        if strategy.is_global_zero:
            try:
                consolidate(directory, path, with_optimizer=True, trust_pickled=True)  # this run's own, just written
            except Exception as raised:
                error = raised
            files.remove(directory)
        message = strategy.broadcast(None if error is None else f"full checkpoint {path!r} failed: {error!r}")
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(message)

    def wait(self, raise_errors: bool = True) -> None:
        """Wait for the save in flight, if any.

        Args:
            raise_errors: raise the save's error; `False` logs it instead.
        """
        self.writer.wait(raise_errors)
