"""Trainer state and what moves in and out of checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import checkpoint as ckpt_io
from .seed import rng_state, set_rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

INTERVALS = ("epoch", "step")


@dataclass
class TrainerState:
    stage: str = "fit"
    epoch: int = 0
    global_step: int = 0
    batches_done_in_epoch: int = (
        0  # micro-batches of the current epoch already trained (for mid-epoch resume)
    )


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch


def _scheduler_config(scheduler: Any) -> dict[str, Any]:
    if isinstance(scheduler, dict):
        if "scheduler" not in scheduler:
            raise ValueError("configure_optimizers: an lr_scheduler dict needs a 'scheduler' key")
        cfg = {"interval": "epoch", "frequency": 1, "name": None, **scheduler}
    else:
        cfg = {"scheduler": scheduler, "interval": "epoch", "frequency": 1, "name": None}
    if cfg["interval"] not in INTERVALS:
        raise ValueError(f"lr_scheduler interval={cfg['interval']!r}; choose one of {list(INTERVALS)}")
    return cfg


def configure_optimizers(
    module: Any, strategy: Any
) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]]]:
    """Call the module's configure_optimizers (after the strategy set the model up) and normalise the result."""
    result = module.configure_optimizers()
    scheduler = None
    if isinstance(result, torch.optim.Optimizer):
        optimizer = result
    elif (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], torch.optim.Optimizer)
    ):
        optimizer, scheduler = result
    elif isinstance(result, dict) and isinstance(result.get("optimizer"), torch.optim.Optimizer):
        optimizer, scheduler = result["optimizer"], result.get("lr_scheduler")
    else:
        raise TypeError(
            "configure_optimizers must return an optimizer, (optimizer, scheduler) or "
            f"{{'optimizer': ..., 'lr_scheduler': ...}}; got {type(result).__name__}"
        )
    optimizer = strategy.setup_optimizer(optimizer)
    configs = [_scheduler_config(scheduler)] if scheduler is not None else []
    return [optimizer], configs


def checkpoint_state(trainer: Trainer) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(this rank's file contents, rank 0's trainer state, metadata) for a checkpoint of `trainer` now."""
    strategy = trainer.strategy
    rank_state = {
        "model": strategy.model_state_pieces(),
        "optimizers": [strategy.optimizer_state_pieces(opt) for opt in trainer.optimizers],
        "rng": rng_state(),
    }
    trainer_state = None
    if trainer.is_global_zero:
        extra: dict[str, Any] = {}
        trainer.module.on_save_checkpoint(extra)
        callbacks = {}
        for cb in trainer.callbacks:
            cb.on_save_checkpoint(trainer, trainer.module, extra)
            callbacks[cb.state_key] = cb.state_dict()
        trainer_state = {
            "state": asdict(trainer.state),
            "lr_schedulers": [cfg["scheduler"].state_dict() for cfg in trainer.lr_scheduler_configs],
            "callbacks": callbacks,
            "precision": trainer.precision.state_dict(),
            "hparams": dict(trainer.module.hparams),
            "module_extra": extra,
        }
    meta = {
        "strategy": repr(strategy),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "aliases": strategy.parameter_aliases(),
        "state_dict_keys": list(trainer.module.state_dict(keep_vars=True)),
    }
    return rank_state, trainer_state, meta


def restore_checkpoint(trainer: Trainer, path: str, weights_only: bool) -> None:
    meta, ranks = ckpt_io.load_rank_files(path)
    model_state = ckpt_io.load_full_state_dict(path)
    check_compatible(trainer, model_state, path)
    trainer.strategy.load_model_state(model_state)
    if weights_only:
        return
    saved = ckpt_io.load_trainer_state(path)
    for index, optimizer in enumerate(trainer.optimizers):
        state, groups = ckpt_io.load_full_optimizer_state(ranks, index)
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"checkpoint {path!r}: optimizer has {len(groups)} parameter groups, "
                f"the module's optimizer has {len(optimizer.param_groups)}"
            )
        trainer.strategy.load_optimizer_state(optimizer, state, groups)
    for cfg, sched_state in zip(trainer.lr_scheduler_configs, saved["lr_schedulers"]):
        cfg["scheduler"].load_state_dict(sched_state)
    for key, value in saved["state"].items():
        setattr(trainer.state, key, value)
    trainer.precision.load_state_dict(saved["precision"])
    for cb in trainer.callbacks:
        if cb.state_key in saved["callbacks"]:
            cb.load_state_dict(saved["callbacks"][cb.state_key])
        cb.on_load_checkpoint(trainer, trainer.module, saved["module_extra"])
    trainer.module.on_load_checkpoint(saved["module_extra"])
    same_layout = meta["world_size"] == trainer.world_size
    if same_layout and len(ranks) > trainer.global_rank:
        set_rng_state(ranks[trainer.global_rank]["rng"])


def check_compatible(trainer: Trainer, model_state: dict[str, torch.Tensor], path: str) -> None:
    """Every difference between the checkpoint and the model, listed at once."""
    expected = {k: v for k, v in trainer.strategy.full_state_shapes().items()}
    problems = []
    for key in sorted(set(expected) - set(model_state)):
        problems.append(f"missing: {key}")
    for key in sorted(set(model_state) - set(expected)):
        problems.append(f"unexpected: {key}")
    for key in sorted(set(expected) & set(model_state)):
        shape, dtype = expected[key]
        if list(model_state[key].shape) != list(shape):
            problems.append(f"shape of {key}: checkpoint {list(model_state[key].shape)}, model {list(shape)}")
        elif model_state[key].dtype != dtype:
            problems.append(f"dtype of {key}: checkpoint {model_state[key].dtype}, model {dtype}")
    if problems:
        raise ValueError(f"ckpt_path={path!r} does not fit this model:\n  " + "\n  ".join(problems))
