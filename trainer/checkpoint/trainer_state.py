"""The trainer's part of a checkpoint: rank 0's trainer state (epoch, step, position in the epoch, schedulers,
callback states, loss scale, hyperparameters, the module's on_save_checkpoint additions), each rank's RNG states,
and the description of the model and optimizers that loading checks against."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..seed import set_rng_state
from .format import FORMAT_VERSION

if TYPE_CHECKING:
    from ..trainer import Trainer


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Rank 0's part of a checkpoint; calls the on_save_checkpoint hooks."""
    extra: dict[str, Any] = {}
    trainer.module.on_save_checkpoint(extra)
    callbacks = {}
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, trainer.module, extra)
        callbacks[cb.state_key] = cb.state_dict()
    return {
        "state": asdict(trainer.state),
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "callbacks": callbacks,
        "precision": trainer.precision.state_dict(),
        "hparams": dict(trainer.module.hparams),
        "module_class": f"{type(trainer.module).__module__}.{type(trainer.module).__qualname__}",
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else None,
        "module_extra": extra,
    }


def meta(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint says about the run and its model: loading checks the model against it."""
    return {
        "format_version": FORMAT_VERSION,
        "world_size": trainer.world_size,
        "strategy": repr(trainer.strategy),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "aliases": trainer.strategy.parameter_aliases(),
        "state_dict_keys": list(trainer.module.state_dict(keep_vars=True)),
        "optimizers": [{"class": type(optimizer).__name__} for optimizer in trainer.optimizers],
    }


def restore_trainer_state(trainer: Trainer, saved: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """Load rank 0's trainer state (and this rank's RNG states, when the world size is the same) into `trainer`;
    calls the on_load_checkpoint hooks."""
    for cfg, sched_state in zip(trainer.lr_scheduler_configs, saved["lr_schedulers"]):
        cfg.scheduler.load_state_dict(sched_state)
    for key, value in saved["state"].items():
        setattr(trainer.state, key, value)
    trainer.precision.load_state_dict(saved["precision"])
    for cb in trainer.callbacks:
        if cb.state_key in saved["callbacks"]:
            cb.load_state_dict(saved["callbacks"][cb.state_key])
        cb.on_load_checkpoint(trainer, trainer.module, saved["module_extra"])
    trainer.module.on_load_checkpoint(saved["module_extra"])
    if trainer.datamodule is not None and saved.get("datamodule") is not None:
        trainer.datamodule.load_state_dict(saved["datamodule"])
    if rng is not None:
        set_rng_state(rng)
