"""Trainer state and batches moved to the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainerState:
    stage: str = "fit"
    epoch: int = 0
    global_step: int = 0
    batches_done_in_epoch: int = 0  # micro-batches of the current epoch already trained (for mid-epoch resume)
    epoch_complete: bool = False  # every batch of the current epoch is trained; its end (hooks, schedulers) is not
    time_elapsed: float = 0.0  # seconds of training so far, over resumes too (max_time counts them); checkpoints
    # keep it beside the rest of this state, which is the same for runs that trained alike


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch
