"""The Trainer's map of owners of state (strategies/checkpoint/stateful.py) for its checkpoints, and the owners
that live in the Trainer: under MODEL and each optimizer's key the engine's shards, then the callbacks' pieces
(an EMA's average), the trainer state (rank 0's: epoch, step, position in the epoch, schedulers, callback states,
loss scale, hyperparameters, the module's on_save_checkpoint additions), each rank's RNG states and, in the
middle of an epoch, its training loader's position."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from strategies.checkpoint.compatibility import Optimizers, describe
from strategies.checkpoint.format import LOADER, META, MODEL, RNG, TRAINER, optim_key
from strategies.checkpoint.stateful import PerRank

from ..seed import RandomState

if TYPE_CHECKING:
    from ..trainer import Trainer


def states_to_save(trainer: Trainer) -> dict[str, Any]:
    """The owners a checkpoint of `trainer` writes, in the order they are asked (the callbacks' pieces before the
    trainer state, which holds the callbacks' state_dict and may follow them)."""
    states = _engine_states(trainer, optimizers(trainer))
    for key, entries in _callback_pieces(trainer).items():
        states[key] = CallbackPieces(trainer, key, entries)
    states[TRAINER] = TrainerPart(trainer)
    rank = trainer.global_rank
    states[RNG] = PerRank(RandomState(), rank, lambda saved_world_size: rank)
    if trainer.state.batches_done_in_epoch:
        states[LOADER] = PerRank(trainer.loader_position, rank, lambda saved_world_size: rank)
    return states


def states_to_load(trainer: Trainer, stored: set[str], weights_only: bool, with_loader: bool) -> dict[str, Any]:
    """The owners loading a checkpoint into `trainer` fills, in order: the model, the optimizers (not with
    `weights_only`), the callbacks' pieces the checkpoint holds (an EMA's average: validation may use it), and
    unless `weights_only` the trainer state, the RNG states when the world size is the same and, with
    `with_loader`, the loader's position. `stored`: the checkpoint's top-level keys."""
    states = _engine_states(trainer, [] if weights_only else optimizers(trainer))
    for key in sorted(k for k in stored if is_callback_key(k)):
        states[key] = CallbackPieces(trainer, key)  # its targets: from ask_callbacks_where_to_load
    if weights_only:
        return states
    states[TRAINER] = TrainerPart(trainer)
    rank, world_size = trainer.global_rank, trainer.world_size
    states[RNG] = PerRank(RandomState(), rank, lambda saved: rank if saved == world_size else None)
    if with_loader:
        # every rank's position, by rank: another world size hands them on (trainer/data/stream_remainder.py)
        states[LOADER] = PerRank(trainer.loader_position, rank, lambda saved: list(range(saved or world_size)))
    return states


def _engine_states(trainer: Trainer, keyed: Optimizers) -> dict[str, Any]:
    states: dict[str, Any] = {MODEL: trainer.strategy.model_state()}
    states.update({key: trainer.strategy.optimizer_state(optimizer, names) for key, optimizer, names in keyed})
    return states


def optimizers(trainer: Trainer) -> Optimizers:
    """The trainer's optimizers with their checkpoint keys and the parameter names of their groups."""
    return [
        (optim_key(i), opt, names) for i, (opt, names) in enumerate(zip(trainer.optimizers, trainer.param_group_names))
    ]


def meta(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint says about the run and its model: loading checks the model against it."""
    described = describe(
        trainer.strategy.model_state(), optimizers(trainer), trainer.world_size, repr(trainer.strategy)
    )
    return {**described, "global_step": trainer.global_step, "epoch": trainer.current_epoch}


class TrainerPart:
    """The trainer state: written by rank 0, read by every rank; loading it calls the on_load_checkpoint hooks."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return trainer_state(self.trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_trainer_state(self.trainer, state_dict)


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Rank 0's part of a checkpoint; calls the on_save_checkpoint hooks."""
    extra: dict[str, Any] = {}
    trainer.module.on_save_checkpoint(extra)
    callbacks = {}
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, trainer.module, extra)
        callbacks[cb.state_key] = cb.state_dict()
    state = asdict(trainer.state)
    time_elapsed = state.pop("time_elapsed")  # apart: it differs between runs that are otherwise the same
    return {
        "state": state,
        "time_elapsed": time_elapsed,
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "callbacks": callbacks,
        "precision": trainer.precision.state_dict(),
        "hparams": dict(trainer.module.hparams),
        "module_class": f"{type(trainer.module).__module__}.{type(trainer.module).__qualname__}",
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else None,
        "module_extra": extra,
        "loggers": [{"class": type(lg).__name__, "state": lg.state_dict()} for lg in trainer.loggers],
        "data_layout": None if trainer.data_layout is None else trainer.data_layout.state_dict(),
    }


def is_callback_key(top: str) -> bool:
    """Whether a top-level checkpoint key may hold a callback's sharded state (Callback.sharded_state)."""
    return top not in (MODEL, TRAINER, RNG, META, LOADER) and not top.startswith("optim")


def _callback_pieces(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """This rank's pieces of the callbacks' sharded state, by top-level key (checked to be free)."""
    out: dict[str, dict[str, Any]] = {}
    for cb in trainer.callbacks:
        for key, entries in cb.sharded_state(trainer).items():
            if not is_callback_key(key) or key in out:
                taken = sorted({MODEL, "optim", TRAINER, RNG, META, LOADER, *out})
                raise ValueError(
                    f"{type(cb).__name__}.sharded_state: key {key!r} is taken (by the checkpoint itself "
                    f"or another callback); taken: {taken}"
                )
            out[key] = entries
    return out


class CallbackPieces:
    """The callbacks' sharded state under one top-level key (Callback.sharded_state): each rank's pieces, read in
    place (Callback.sharded_state_targets).

    Args:
        trainer: the Trainer.
        key: the top-level key.
        entries: when saving, this rank's pieces under `key`; when loading, where they are read (filled in place).
    """

    def __init__(self, trainer: Trainer, key: str, entries: dict[str, Any] | None = None) -> None:
        self.trainer, self.key, self.entries = trainer, key, entries or {}

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.strategy.model_state().in_full_coordinates(self.entries, writing=True)

    def load_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        return self.trainer.strategy.model_state().in_full_coordinates(self.entries, writing=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The targets were filled in place."""


def ask_callbacks_where_to_load(trainer: Trainer, states: dict[str, Any], saved: dict[str, Any]) -> None:
    """Every callback's Callback.sharded_state_targets, asked once with all the callbacks' sharded state the
    checkpoint holds (none: a callback that keeps such state starts it again), given to the owners of `states`."""
    held = {key: saved.get(key, {}) for key, owner in states.items() if isinstance(owner, CallbackPieces)}
    for cb in trainer.callbacks:
        for top, entries in cb.sharded_state_targets(trainer, held).items():
            for name, target in entries.items():
                if name not in held.get(top, {}):
                    raise ValueError(f"{type(cb).__name__}.sharded_state_targets: the checkpoint holds no {top}.{name}")
                states[top].entries[name] = target


def restore_trainer_state(trainer: Trainer, saved: dict[str, Any]) -> None:
    """Load rank 0's trainer state into `trainer`; calls the on_load_checkpoint hooks."""
    for cfg, sched_state in zip(trainer.lr_scheduler_configs, saved["lr_schedulers"]):
        cfg.scheduler.load_state_dict(sched_state)
    for key, value in saved["state"].items():
        if key != "stage":  # what the trainer is doing now (fit), not where the saved run was (maybe validate)
            setattr(trainer.state, key, value)
    trainer.state.time_elapsed = saved.get("time_elapsed", 0.0)  # (checkpoints from before max_time: none)
    trainer.precision.load_state_dict(saved["precision"])
    trainer.resumed_layout = saved.get("data_layout")  # (older checkpoints: none)
    for cb in trainer.callbacks:
        if cb.state_key in saved["callbacks"]:
            cb.load_state_dict(saved["callbacks"][cb.state_key])
        cb.on_load_checkpoint(trainer, trainer.module, saved["module_extra"])
    trainer.module.on_load_checkpoint(saved["module_extra"])
    for logger, entry in zip(trainer.loggers, saved.get("loggers", [])):  # (older checkpoints: none)
        if entry["class"] == type(logger).__name__:  # the same logger in the same place: e.g. W&B's run id
            logger.load_state_dict(entry["state"])
    if trainer.datamodule is not None and saved.get("datamodule") is not None:
        trainer.datamodule.load_state_dict(saved["datamodule"])
