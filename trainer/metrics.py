"""What `TrainModule.log` records: step values for the logger, epoch averages, and the latest of each.

An epoch value is the mean over its steps weighted by each step's batch size, so that it equals one process's mean
over the samples when batches (or ranks) hold different numbers of them; with `sync_dist` the weighted sums of all
ranks are added. The batch size is that of the first tensor in the batch (as Lightning infers it), or the
`batch_size` given to `self.log`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def infer_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in `batch`; 1 when it holds no tensor with one."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0] if leaf.dim() > 0 else 1
    return 1


@dataclass
class _EpochValue:
    total: torch.Tensor  # sum of value x weight
    weight: float = 0.0
    sync_dist: bool = False
    prog_bar: bool = False


@dataclass
class MetricCollector:
    """Collects logged values for one stage at a time ("train", "validate", "test", "predict")."""

    reduce_sum: ReduceSum
    stage: str = "train"
    step_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    progress_bar_metrics: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1  # of the running step; set by the loop from its batch
    discarding: bool = False  # the running step is an empty one of a rank that has run out: its logs weigh nothing
    _epoch: dict[str, _EpochValue] = field(default_factory=dict)

    def start_step(self, batch: Any, real: bool = True) -> None:
        self.batch_size, self.discarding = infer_batch_size(batch), not real

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        sync_dist: bool,
        batch_size: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log: name must be a non-empty string, got {name!r}")
        value = self._as_scalar(name, value)
        weight = 0.0 if self.discarding else float(self._check_batch_size(name, batch_size))
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise ValueError(
                f"self.log({name!r}): on_step and on_epoch are both False, so nothing would be logged"
            )
        if on_step:
            step_value = self._weighted_mean(value, weight) if sync_dist else value
            step_name = f"{name}_step" if on_epoch else name
            if not self.discarding:
                self.step_metrics[step_name] = step_value
                self._publish(step_name, step_value, prog_bar)
        if on_epoch:
            entry = self._epoch.setdefault(name, _EpochValue(torch.zeros((), dtype=torch.float64)))
            if weight:
                entry.total += value.double() * weight
                entry.weight += weight
            entry.sync_dist, entry.prog_bar = entry.sync_dist or sync_dist, entry.prog_bar or prog_bar

    def _check_batch_size(self, name: str, batch_size: Any) -> int:
        if batch_size is None:
            return self.batch_size
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"self.log({name!r}): batch_size={batch_size!r} is not valid; use a positive int")
        return batch_size

    def _weighted_mean(self, value: torch.Tensor, weight: float) -> torch.Tensor:
        """The mean over ranks of this step's value, each rank weighted by its batch size (a discarded step's
        value, maybe NaN, counts for nothing). Stays on the device: no sync."""
        weighted = value * weight if weight else torch.zeros_like(value)
        total, weight_sum = self.reduce_sum(torch.stack([weighted, torch.full_like(value, weight)]))
        return total / weight_sum

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

    def record(self, name: str, value: float) -> None:
        """A value the Trainer itself logs at this step (such as a count of skipped steps)."""
        self.step_metrics[name] = torch.tensor(float(value))
        self._publish(name, self.step_metrics[name], prog_bar=False)

    def pop_step_metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.step_metrics.items()}
        self.step_metrics.clear()
        return out

    def end_epoch(self) -> dict[str, float]:
        """Average each epoch value (over ranks too with sync_dist), publish them, and start a new epoch.
        Every rank must call this: the synced values of all names travel in one all-reduce, in sorted order."""
        names = sorted(self._epoch)
        synced = [n for n in names if self._epoch[n].sync_dist]
        sums = {n: (self._epoch[n].total, self._epoch[n].weight) for n in names}
        if synced:
            totals = torch.stack([sums[n][0] for n in synced])
            weights = torch.tensor([sums[n][1] for n in synced], dtype=torch.float64)
            reduced = self.reduce_sum(torch.cat([totals, weights])).tolist()
            sums.update({n: (reduced[i], reduced[len(synced) + i]) for i, n in enumerate(synced)})
        out = {}
        for name in names:
            total, weight = (float(x) for x in sums[name])
            mean = torch.tensor(total / weight if weight else float("nan"))
            published = f"{name}_epoch" if f"{name}_step" in self.callback_metrics else name
            self._publish(published, mean, self._epoch[name].prog_bar)
            out[published] = float(mean)
        self._epoch.clear()
        return out
