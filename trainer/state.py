"""Trainer state, batches moved to the device, and the optimizers configure_optimizers returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]], list[list[list[str]]]]:
    """Call the module's configure_optimizers (after the strategy set the model up) and normalise the result:
    optimizers, scheduler configs, and the parameter names of each optimizer's groups."""
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
    names = _param_group_names(module, optimizer)  # before the strategy swaps parameters for shards
    optimizer = strategy.setup_optimizer(optimizer)
    configs = [_scheduler_config(scheduler)] if scheduler is not None else []
    return [optimizer], configs, [names]


def _param_group_names(module: Any, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [[name_of[id(p)] for p in group["params"] if id(p) in name_of] for group in optimizer.param_groups]
