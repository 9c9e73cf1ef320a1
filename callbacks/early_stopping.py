"""Stop training when a monitored metric has stopped improving."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from callbacks._monitor import broadcast_metric, check_mode, why_missing
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainModule

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stops training once a monitored metric has not improved by more than `min_delta` in `patience` checks.

    It sets `trainer.should_stop`. The check runs after each validation (or at the end of each training epoch
    with `check_on_train_epoch_end=True`, or when the fit has no validation). Rank 0's value of the metric is
    broadcast first, so every rank keeps the same state and takes the same decision even when the metric was
    logged without `sync_dist`.

    Args:
        monitor: the logged metric to watch.
        min_delta: the smallest change that counts as an improvement (its absolute value is used).
        patience: how many checks without improvement stop training (`0`: the first check without improvement).
        verbose: log (at INFO level, on rank 0) why each check improved or stopped.
        mode: `"min"` (lower is better) or `"max"`.
        strict: a metric missing at a check raises `ValueError`; `False` logs a warning and skips the check.
        check_finite: stop when the metric is NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this value.
        divergence_threshold: stop as soon as the metric is worse than this value.
        check_on_train_epoch_end: check at the end of each training epoch instead of after validation.

    Raises:
        ValueError: if `mode` is not `"min"` or `"max"` or `patience < 0`; during `fit`, with `strict=True`, if
            `monitor` is not logged when a check is due.
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool = False,
    ) -> None:
        check_mode("EarlyStopping", mode)
        if patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience}) must be >= 0")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.stopped_epoch = int(state_dict["stopped_epoch"])
        self.best_score = float(state_dict["best_score"])

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not self.check_on_train_epoch_end and not _skip(trainer):
            self._run_check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        # without validation in this fit, at the end of each training epoch (as Lightning): a monitored
        # validation metric that never comes is then an error, not a check that never runs
        if (self.check_on_train_epoch_end or not trainer.num_val_batches) and not _skip(trainer):
            self._run_check(trainer)

    def _run_check(self, trainer: Trainer) -> None:
        current = broadcast_metric(trainer, self.monitor)
        if current is None:
            message = (
                f"EarlyStopping(monitor={self.monitor!r}) could not find the metric; available "
                f"metrics: {sorted(trainer.callback_metrics)}. "
                f"Log it with self.log({self.monitor!r}, value).{why_missing(trainer)}"
            )
            if self.strict:
                raise ValueError(message)
            log.warning(message)
            return
        should_stop, reason = self.evaluate(current)
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
        if reason and self.verbose and trainer.is_global_zero:
            log.info(reason)

    def _improved(self, current: float, reference: float) -> bool:
        return current < reference if self.mode == "min" else current > reference

    def evaluate(self, current: float) -> tuple[bool, str | None]:
        """Update the state with one new value of the metric.

        Args:
            current: the metric's value.

        Returns:
            Whether to stop now, and why (or None when there is nothing to say).
        """
        name = self.monitor
        if self.check_finite and not math.isfinite(current):
            return True, f"{name} = {current} is not finite; stopping. Best score: {self.best_score:.6g}."
        if self.stopping_threshold is not None and self._improved(current, self.stopping_threshold):
            return True, f"{name} = {current:.6g} reached the stopping threshold {self.stopping_threshold}."
        if self.divergence_threshold is not None and self._improved(self.divergence_threshold, current):
            return True, f"{name} = {current:.6g} passed divergence_threshold={self.divergence_threshold}"
        shift = -self.min_delta if self.mode == "min" else self.min_delta
        if self._improved(current, self.best_score + shift):
            reason = f"{name} improved to {current:.6g} (was {self.best_score:.6g})."
            self.best_score, self.wait_count = current, 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (
                f"{name} did not improve by more than {self.min_delta} in {self.wait_count} "
                f"checks. Best score: {self.best_score:.6g}. Stopping."
            )
        return False, None


def _skip(trainer: Trainer) -> bool:
    return trainer.state.stage != "fit" or trainer.sanity_checking
