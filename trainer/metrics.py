"""What `TrainModule.log` records: step values for the logger, epoch averages, and the latest of each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ReduceMean = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _EpochValue:
    total: torch.Tensor
    count: int = 0
    sync_dist: bool = False
    prog_bar: bool = False


@dataclass
class MetricCollector:
    """Collects logged values for one stage at a time ("train", "validate", "test", "predict")."""

    reduce_mean: ReduceMean
    stage: str = "train"
    step_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    progress_bar_metrics: dict[str, float] = field(default_factory=dict)
    _epoch: dict[str, _EpochValue] = field(default_factory=dict)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        sync_dist: bool,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log: name must be a non-empty string, got {name!r}")
        value = self._as_scalar(name, value)
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise ValueError(
                f"self.log({name!r}): on_step and on_epoch are both False, so nothing would be logged"
            )
        if on_step:
            step_value = self.reduce_mean(value) if sync_dist else value
            step_name = f"{name}_step" if on_epoch else name
            self.step_metrics[step_name] = step_value
            self._publish(step_name, step_value, prog_bar)
        if on_epoch:
            entry = self._epoch.setdefault(name, _EpochValue(torch.zeros((), dtype=torch.float64)))
            entry.total += value.double()
            entry.count += 1
            entry.sync_dist, entry.prog_bar = entry.sync_dist or sync_dist, entry.prog_bar or prog_bar

    @staticmethod
    def _as_scalar(name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}): expected a scalar, got a tensor of shape {tuple(value.shape)}"
                )
            return value.detach().reshape(()).float()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value))
        raise TypeError(
            f"self.log({name!r}): value must be a number or a one-element tensor, got {type(value).__name__}"
        )

    def _publish(self, name: str, value: torch.Tensor, prog_bar: bool) -> None:
        self.callback_metrics[name] = value.detach().cpu()
        if prog_bar:
            self.progress_bar_metrics[name] = float(value)

    def pop_step_metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.step_metrics.items()}
        self.step_metrics.clear()
        return out

    def end_epoch(self, step_and_epoch_names: bool = True) -> dict[str, float]:
        """Average each epoch value (over ranks too with sync_dist), publish them, and start a new epoch.
        Every rank must call this: names are reduced in sorted order."""
        out = {}
        for name in sorted(self._epoch):
            entry = self._epoch[name]
            mean = (entry.total / max(entry.count, 1)).float()
            if entry.sync_dist:
                mean = self.reduce_mean(mean)
            published = f"{name}_epoch" if f"{name}_step" in self.callback_metrics else name
            self._publish(published, mean, entry.prog_bar)
            out[published] = float(mean)
        self._epoch.clear()
        return out
