"""The trainer's part of a checkpoint: rank 0's trainer state (epoch, step, position in the epoch, schedulers,
callback states, loss scale, hyperparameters, the module's on_save_checkpoint additions), each rank's RNG states,
and the description of the model and optimizers that loading checks against."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from strategies.checkpoint import model_state
from strategies.checkpoint.format import LOADER, META, MODEL, RNG, TRAINER, optim_key

from ..seed import set_rng_state

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


def optimizers(trainer: Trainer) -> model_state.Optimizers:
    """The trainer's optimizers with their checkpoint keys and the parameter names of their groups."""
    return [(optim_key(i), opt, names) for i, (opt, names) in enumerate(zip(trainer.optimizers,
                                                                            trainer.param_group_names))]


def meta(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint says about the run and its model: loading checks the model against it."""
    described = model_state.describe(trainer.strategy, trainer.module, optimizers(trainer))
    return {**described, "global_step": trainer.global_step, "epoch": trainer.current_epoch}


def is_callback_key(top: str) -> bool:
    """Whether a top-level checkpoint key may hold a callback's sharded state (Callback.sharded_state)."""
    return top not in (MODEL, TRAINER, RNG, META, LOADER) and not top.startswith("optim")


def callbacks_sharded_state(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """This rank's pieces of the callbacks' sharded state, by top-level key."""
    out: dict[str, dict[str, Any]] = {}
    for cb in trainer.callbacks:
        for key, entries in cb.sharded_state(trainer).items():
            if not is_callback_key(key) or key in out:
                taken = sorted({MODEL, "optim", TRAINER, RNG, META, LOADER, *out})
                raise ValueError(f"{type(cb).__name__}.sharded_state: key {key!r} is taken (by the checkpoint itself "
                                 f"or another callback); taken: {taken}")
            out[key] = entries
    return out


def callbacks_sharded_targets(trainer: Trainer, source: Any) -> dict[str, Any]:
    """Where the callbacks read their sharded state (Callback.sharded_state_targets), by checkpoint key."""
    saved: dict[str, dict[str, Any]] = {}
    keys = {}
    for key, path in source.paths.items():
        if key in source.tensors and len(path) == 2 and is_callback_key(path[0]):
            saved.setdefault(path[0], {})[path[1]] = source.tensors[key]
            keys[path] = key
    out = {}
    for cb in trainer.callbacks:
        for top, entries in cb.sharded_state_targets(trainer, saved).items():
            for name, target in entries.items():
                if (top, name) not in keys:
                    raise ValueError(f"{type(cb).__name__}.sharded_state_targets: the checkpoint holds no {top}.{name}")
                out[keys[top, name]] = target
    return out


def restore_trainer_state(trainer: Trainer, saved: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """Load rank 0's trainer state (and this rank's RNG states, when the world size is the same) into `trainer`;
    calls the on_load_checkpoint hooks."""
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
    if rng is not None:
        set_rng_state(rng)
