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

Reduce = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, "sum" | "max" | "min") over the ranks
REDUCE_FX = ("mean", "sum", "max", "min")
_START = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def infer_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in `batch`; 1 when it holds no tensor with one."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0] if leaf.dim() > 0 else 1
    return 1


def reduce_fx_name(name: str, reduce_fx: Any) -> str:
    """"mean", "sum", "max" or "min", given as such or as torch's function (torch.mean, ...), as Lightning takes."""
    fx = getattr(reduce_fx, "__name__", reduce_fx)
    if fx not in REDUCE_FX:
        raise ValueError(f"self.log({name!r}): reduce_fx={reduce_fx!r}; choose one of {list(REDUCE_FX)} "
                         "(or torch.mean, torch.sum, torch.max, torch.min)")
    return fx


@dataclass
class _EpochValue:
    reduce_fx: str
    total: torch.Tensor  # mean: the sum of value x weight; sum: the sum; max, min: the extreme
    weight: float = 0.0
    sync_dist: bool = False
    prog_bar: bool = False
    to_logger: bool = True

    def add(self, value: torch.Tensor, weight: float) -> None:
        if not weight:
            return
        if self.reduce_fx == "mean":
            self.total += value.double() * weight
        elif self.reduce_fx == "sum":
            self.total += value.double()
        else:
            self.total = getattr(torch, self.reduce_fx)(self.total, value.double())
        self.weight += weight

    def result(self, total: float, weight: float) -> float:
        if not weight:
            return float("nan")
        return total / weight if self.reduce_fx == "mean" else total


@dataclass
class MetricCollector:
    """Collects logged values for one stage at a time ("train", "validate", "test", "predict")."""

    reduce: Reduce
    stage: str = "train"
    step_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    progress_bar_metrics: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1  # of the running step; set by the loop from its batch
    discarding: bool = False  # the running step is a filler one of a rank that has run out: its logs weigh nothing
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
        reduce_fx: Any = "mean",
        logger: bool = True,
        rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log: name must be a non-empty string, got {name!r}")
        if sync_dist and rank_zero_only:
            raise ValueError(f"self.log({name!r}): sync_dist=True and rank_zero_only=True contradict each other: a "
                             "value logged on rank 0 only cannot be synchronised across ranks")
        fx = reduce_fx_name(name, reduce_fx)
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
            step_value = self._across_ranks(value, weight, fx) if sync_dist else value
            step_name = f"{name}_step" if on_epoch else name
            if not self.discarding:
                if logger:
                    self.step_metrics[step_name] = step_value
                self._publish(step_name, step_value, prog_bar)
        if on_epoch:
            entry = self._epoch.setdefault(name, _EpochValue(fx, torch.tensor(_START[fx], dtype=torch.float64)))
            entry.add(value, weight)
            entry.sync_dist, entry.prog_bar = entry.sync_dist or sync_dist, entry.prog_bar or prog_bar
            entry.to_logger = entry.to_logger and logger

    def _check_batch_size(self, name: str, batch_size: Any) -> int:
        if batch_size is None:
            return self.batch_size
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"self.log({name!r}): batch_size={batch_size!r} is not valid; use a positive int")
        return batch_size

    def _across_ranks(self, value: torch.Tensor, weight: float, fx: str) -> torch.Tensor:
        """This step's value reduced over the ranks: the mean weighted by each rank's batch size (a discarded
        step's value, maybe NaN, counts for nothing), or the sum, max or min. Stays on the device: no sync."""
        if fx != "mean":
            neutral = torch.full_like(value, _START[fx])
            return self.reduce(value if weight else neutral, fx)
        weighted = value * weight if weight else torch.zeros_like(value)
        total, weight_sum = self.reduce(torch.stack([weighted, torch.full_like(value, weight)]), "sum")
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
        sums = {n: (self._epoch[n].total, self._epoch[n].weight) for n in names}
        for op in ("sum", "max", "min"):  # one all-reduce per kind of reduction in use, in a fixed order
            synced = [n for n in names if self._epoch[n].sync_dist and _op(self._epoch[n].reduce_fx) == op]
            if not synced:
                continue
            totals = torch.stack([sums[n][0] for n in synced])
            weights = torch.tensor([sums[n][1] for n in synced], dtype=torch.float64)
            if op == "sum":  # totals and weights in one all-reduce
                reduced = self.reduce(torch.cat([totals, weights]), "sum").tolist()
                totals_r, weights_r = reduced[: len(synced)], reduced[len(synced) :]
            else:
                totals_r, weights_r = self.reduce(totals, op).tolist(), self.reduce(weights, "sum").tolist()
            sums.update({n: (totals_r[i], weights_r[i]) for i, n in enumerate(synced)})
        out = {}
        for name in names:
            entry = self._epoch[name]
            value = torch.tensor(entry.result(*(float(x) for x in sums[name])))
            published = f"{name}_epoch" if f"{name}_step" in self.callback_metrics else name
            self._publish(published, value, entry.prog_bar)
            if entry.to_logger:
                out[published] = float(value)
        self._epoch.clear()
        return out

    def forget_published(self) -> None:
        """Drop what was published (after the sanity check, whose values are not the run's)."""
        self.callback_metrics.clear()
        self.progress_bar_metrics.clear()
        self.step_metrics.clear()


def _op(reduce_fx: str) -> str:
    return "sum" if reduce_fx in ("mean", "sum") else reduce_fx
