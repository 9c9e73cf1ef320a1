"""Reading monitored metrics so that every rank sees the same numbers and takes the same decision."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer import Trainer

MODES = ("min", "max")


def check_mode(owner: str, mode: str) -> None:
    if mode not in MODES:
        choices = ", ".join(map(repr, MODES))
        raise ValueError(f"{owner}(mode={mode!r}) is not valid: `mode` must be one of {choices}")


def local_metrics(trainer: Trainer) -> dict[str, float]:
    """This rank's scalar callback metrics as floats, plus "epoch" and "step" (for checkpoint file names)."""
    metrics = {}
    for name, value in trainer.callback_metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        metrics[name] = float(value)
    metrics["epoch"] = trainer.current_epoch
    metrics["step"] = trainer.global_step
    return metrics


def broadcast_metrics(trainer: Trainer) -> dict[str, float]:
    """Rank 0's metrics, on every rank (collective)."""
    return trainer.strategy.broadcast(local_metrics(trainer) if trainer.is_global_zero else None, src=0)


def broadcast_metric(trainer: Trainer, name: str) -> float | None:
    """Rank 0's value of one metric, on every rank (collective); None when rank 0 has not logged it."""
    value = trainer.callback_metrics.get(name) if trainer.is_global_zero else None
    if isinstance(value, torch.Tensor):
        value = value.float().mean().item()
    value = trainer.strategy.broadcast(value, src=0)
    return None if value is None else float(value)


def why_missing(trainer: Trainer) -> str:
    """What the Trainer knows of why a metric was never logged (validation that did not run), or ""."""
    reason = getattr(trainer, "skipped_validation", None)
    return f" Validation did not run: {reason}." if reason else ""
