"""A trainer's checkpoints through the checkpoint component (strategies/checkpoint/): saving its owners of state
(states.py) with at most one save in flight, as a directory or one plain file, and restoring them after the
checkpoint was checked against the model (every difference listed at once)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from strategies.checkpoint import checkpointer, files
from strategies.checkpoint.compatibility import problems, saved_class
from strategies.checkpoint.format import LOADER, MODEL, TRAINER
from strategies.checkpoint.writer import CheckpointWriter

from .states import ask_callbacks_where_to_load, meta, optimizers, states_to_load, states_to_save

if TYPE_CHECKING:
    from ..trainer import Trainer


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
        described = meta(trainer) if trainer.is_global_zero else None
        checkpointer.save(
            self.writer,
            states_to_save(trainer),
            path,
            trainer.global_rank,
            described,
            summary,
            async_save=async_save,
            links=links,
            on_done=on_done,
            texts=self.texts,
        )

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
        from strategies.checkpoint.export import consolidate

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


def restore(trainer: Trainer, path: str, weights_only: bool, trust_pickled: bool = False) -> None:
    """Load a checkpoint (a directory or a full file) into `trainer`, after checking that all of it fits."""
    loading = checkpointer.Loading(path, trust_pickled)
    stored = loading.stored_keys()
    saved_world_size = loading.meta.get("world_size", trainer.world_size)
    with_loader = not weights_only and LOADER in stored and trainer.restore_loader_state
    states = states_to_load(trainer, stored, weights_only, with_loader)
    saved = loading.read(states)
    if not weights_only and TRAINER not in saved:
        raise ValueError(
            f"ckpt_path={path!r} holds weights only; fit resumes from a checkpoint directory or from a file "
            "written by trainer.save_checkpoint(path, full=True)"
        )
    check_compatible(trainer, loading, path, weights_only)
    ask_callbacks_where_to_load(trainer, states, saved)
    loading.load()
    if not weights_only:
        trainer.loader_position.pending_from = (path, saved_world_size)


def check_compatible(trainer: Trainer, loading: checkpointer.Loading, path: str, weights_only: bool = False) -> None:
    """Every difference between the checkpoint and the model (and, unless `weights_only`, its optimizers),
    listed at once in one ValueError."""
    count = len(loading.meta.get("optimizers", []))
    extra: list[str] = []
    compared = []
    if not weights_only and count != len(trainer.optimizers):
        extra = [f"optimizers: checkpoint {count}, module {len(trainer.optimizers)}"]
    elif not weights_only:
        compared = [
            (optimizer, names, loading.saved.get(key, {}), saved_class(loading.meta, key))
            for key, optimizer, names in optimizers(trainer)
        ]
    found = problems(loading.states[MODEL], loading.saved.get(MODEL, {}), loading.meta, compared) + extra
    if found:
        raise ValueError(f"ckpt_path={path!r} does not fit this model:\n  " + "\n  ".join(found))
