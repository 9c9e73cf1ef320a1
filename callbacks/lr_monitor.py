"""Log the learning rate of every parameter group of every optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer import Trainer, TrainModule

INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Logs the learning rate of every parameter group of every optimizer during training.

    The names are `"lr-<OptimizerClass>"` (or the scheduler's `name`), with `"/pg<i>"` (1-based, or the group's
    `"name"`) when an optimizer has several parameter groups; a repeated name gets `"-1"`, `"-2"`, ... Values also
    go into `trainer.callback_metrics`.

    Args:
        logging_interval: `"step"`: before every optimizer step that the loggers would log
            (`global_step % trainer.log_every_n_steps == 0`); `"epoch"`: at the start of every epoch; `None`:
            at each scheduler's own interval (optimizers without a scheduler are logged at both).
        log_momentum: also log `"<name>-momentum"` (the momentum, or Adam's first beta).
        log_weight_decay: also log `"<name>-weight_decay"`.

    Raises:
        ValueError: if `logging_interval` is not `None`, `"step"` or `"epoch"`; when training starts, if the
            Trainer has no logger.
    """

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in INTERVALS:
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) is not valid: "
                "`logging_interval` must be one of None, 'step', 'epoch'"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._last_logged_step = -1

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger, but the Trainer has none (logger=False)")
        self._last_logged_step = -1

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # One log per optimizer step: accumulation calls this hook on every micro-batch of the step.
        if self.logging_interval == "epoch" or step == self._last_logged_step:
            return
        if step % trainer.log_every_n_steps != 0:
            return
        self._last_logged_step = step
        self._log(trainer, "step" if self.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else "any")

    def _log(self, trainer: Trainer, interval: str) -> None:
        stats = self.extract_stats(trainer, interval)
        if not stats:
            return
        for name, value in stats.items():
            trainer.callback_metrics[name] = torch.tensor(value)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=trainer.global_step)

    def extract_stats(self, trainer: Trainer, interval: str = "any") -> dict[str, float]:
        """The values to log now: of the optimizers whose scheduler steps at `interval`, and of the optimizers
        without a scheduler.

        Args:
            trainer: the Trainer.
            interval: `"step"`, `"epoch"` or `"any"` (every optimizer).

        Returns:
            The values by name.
        """
        stats: dict[str, float] = {}
        for name, optimizer, opt_interval in self._named_optimizers(trainer):
            if interval in ("any", opt_interval) or opt_interval is None:
                stats.update(self._optimizer_stats(name, optimizer))
        return stats

    def _named_optimizers(self, trainer: Trainer) -> list[tuple[str, Optimizer, str | None]]:
        """(name, optimizer, its scheduler's interval or None) for each optimizer, scheduled ones first."""
        found: list[tuple[str, Optimizer, str | None]] = []
        seen: set[int] = set()
        for config in trainer.lr_scheduler_configs:
            optimizer = _unwrap(config.scheduler.optimizer)
            if id(optimizer) not in seen:
                seen.add(id(optimizer))
                found.append((config.name or _default_name(optimizer), optimizer, config.interval))
        for optimizer in map(_unwrap, trainer.optimizers):
            if id(optimizer) not in seen:
                seen.add(id(optimizer))
                found.append((_default_name(optimizer), optimizer, None))
        return _deduplicate(found)

    def _optimizer_stats(self, name: str, optimizer: Optimizer) -> dict[str, float]:
        groups = optimizer.param_groups
        stats: dict[str, float] = {}
        for i, group in enumerate(groups):
            key = name if len(groups) == 1 else f"{name}/{group.get('name', f'pg{i + 1}')}"
            stats[key] = float(group["lr"])
            if self.log_momentum:
                momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                stats[f"{key}-momentum"] = float(momentum)
            if self.log_weight_decay:
                stats[f"{key}-weight_decay"] = float(group.get("weight_decay", 0.0))
        return stats


def _default_name(optimizer: Optimizer) -> str:
    return f"lr-{type(optimizer).__name__}"


def _deduplicate(found: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    counts: dict[str, int] = {}
    renamed = []
    for name, optimizer, interval in found:
        n = counts.get(name, 0)
        counts[name] = n + 1
        renamed.append((name if n == 0 else f"{name}-{n}", optimizer, interval))
    return renamed


def _unwrap(optimizer: Any) -> Any:
    """The user's optimizer inside a wrapper that keeps it as `.optimizer` or `._optimizer`."""
    for attr in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return _unwrap(inner)
    return optimizer
