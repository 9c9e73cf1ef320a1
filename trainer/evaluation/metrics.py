"""What `TrainModule.log` records: step values for the logger, epoch averages, metric objects, and the latest of each.

An epoch value is the mean over its steps weighted by each step's batch size, so that it equals one process's mean
over the samples when batches (or ranks) hold different numbers of them; with `sync_dist` the weighted sums of all
ranks are added. The batch size is that of the first tensor in the batch (as Lightning infers it), or the
`batch_size` given to `self.log`. A metric object (torchmetrics) is logged as Lightning logs it (metric_objects.py).
Each stage keeps its own epoch values, so a validation inside a training epoch does not close the training epoch's.
What the epoch-end hooks log (after `start_epoch_end`) is per epoch by default and belongs to that epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .metric_objects import EpochMetric, agree_on_entries, compute, is_metric, reset, step_value

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
    """ "mean", "sum", "max" or "min", given as such or as torch's function (torch.mean, ...), as Lightning takes."""
    fx = getattr(reduce_fx, "__name__", reduce_fx)
    if fx not in REDUCE_FX:
        raise ValueError(
            f"self.log({name!r}): reduce_fx={reduce_fx!r}; choose one of {list(REDUCE_FX)} "
            "(or torch.mean, torch.sum, torch.max, torch.min)"
        )
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
    """Collects logged values by stage ("train", "validate", "test", "predict"); `stage` is the running one."""

    reduce: Reduce
    gather: Callable[[Any], list[Any]] = lambda obj: [obj]  # every rank's object (all_gather_object)
    data_parallel_group: Callable[[], Any] = lambda: None  # where metric objects sync under tensor parallel
    stage: str = "train"
    step_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    progress_bar_metrics: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1  # of the running step; set by the loop from its batch
    at_epoch_end: bool = False  # in an epoch-end hook: per epoch by default, no step to log at
    _epoch: dict[str, dict[str, _EpochValue]] = field(default_factory=dict)  # by stage, by name
    _metrics: dict[str, dict[str, EpochMetric]] = field(default_factory=dict)  # metric objects, by stage, by name
    _computed: dict[str, dict[str, Any]] = field(default_factory=dict)  # before the epoch-end hook, by stage

    def start_step(self, batch: Any) -> None:
        self.batch_size, self.at_epoch_end = infer_batch_size(batch), False

    def start_epoch_end(self, module: Any = None, some_rank_idle: bool = False) -> None:
        """Before the epoch-end hooks: the metric objects logged in the steps are computed and published (as
        Lightning computes them there, so a reset in the hook does not lose them); what the hooks log next is per
        epoch (by default) and belongs to the epoch ending. Every rank calls it; `module`, `some_rank_idle`: as
        for end_epoch."""
        metrics = self._metrics.setdefault(self.stage, {})
        if some_rank_idle:  # a rank that ran no step finds the metrics the others logged, to compute them too
            agree_on_entries(self._epoch.setdefault(self.stage, {}), metrics, module, self.gather, _synced_placeholder)
        computed = compute(metrics, {}, self.data_parallel_group())
        for name, (value, prog_bar, _) in computed.items():
            self._publish(self._epoch_name(name), value, prog_bar)
        self._computed[self.stage] = computed
        self.batch_size, self.at_epoch_end = 1, True

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
            raise ValueError(
                f"self.log({name!r}): sync_dist=True and rank_zero_only=True contradict each other: a "
                "value logged on rank 0 only cannot be synchronised across ranks"
            )
        fx = reduce_fx_name(name, reduce_fx)
        on_step, on_epoch = self._when(name, on_step, on_epoch)
        if is_metric(value):  # synced by itself in compute(): sync_dist adds nothing
            if on_step:
                self._log_step(name, step_value(name, value), prog_bar, logger, on_epoch)
            self._metrics.setdefault(self.stage, {})[name] = EpochMetric(value, prog_bar, logger, on_epoch)
            return
        value = self._as_scalar(name, value)
        weight = float(self._check_batch_size(name, batch_size))
        if on_step:
            self._log_step(
                name, self._across_ranks(value, weight, fx) if sync_dist else value, prog_bar, logger, on_epoch
            )
        if on_epoch:
            values = self._epoch.setdefault(self.stage, {})
            entry = values.setdefault(name, _EpochValue(fx, torch.tensor(_START[fx], dtype=torch.float64)))
            entry.add(value, weight)
            entry.sync_dist, entry.prog_bar = entry.sync_dist or sync_dist, entry.prog_bar or prog_bar
            entry.to_logger = entry.to_logger and logger

    def _when(self, name: str, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
        """on_step and on_epoch, with Lightning's defaults: per step in training steps, per epoch elsewhere."""
        per_step = self.stage == "train" and not self.at_epoch_end
        on_step = per_step if on_step is None else on_step
        on_epoch = (not per_step) if on_epoch is None else on_epoch
        if on_step and self.at_epoch_end:
            raise ValueError(
                f"self.log({name!r}, on_step=True) in an epoch-end hook: there is no step there; log "
                "it per epoch (on_epoch=True, the default there)"
            )
        if not on_step and not on_epoch:
            raise ValueError(f"self.log({name!r}): on_step and on_epoch are both False, so nothing would be logged")
        return on_step, on_epoch

    def _log_step(self, name: str, value: torch.Tensor, prog_bar: bool, logger: bool, on_epoch: bool) -> None:
        step_name = f"{name}_step" if on_epoch else name
        if logger:
            self.step_metrics[step_name] = value
        self._publish(step_name, value, prog_bar)

    def _check_batch_size(self, name: str, batch_size: Any) -> int:
        if batch_size is None:
            return self.batch_size
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"self.log({name!r}): batch_size={batch_size!r} is not valid; use a positive int")
        return batch_size

    def _across_ranks(self, value: torch.Tensor, weight: float, fx: str) -> torch.Tensor:
        """This step's value reduced over the ranks: the mean weighted by each rank's batch size, or the sum, max
        or min. Stays on the device: no sync."""
        if fx != "mean":
            return self.reduce(value, fx)
        total, weight_sum = self.reduce(torch.stack([value * weight, torch.full_like(value, weight)]), "sum")
        return total / weight_sum

    @staticmethod
    def _as_scalar(name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}): expected a scalar, got a tensor of shape {tuple(value.shape)}")
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

    def end_epoch(self, module: Any = None, some_rank_idle: bool = False) -> dict[str, float]:
        """Close the running stage's epoch: each metric object's compute() (then reset()), each epoch value averaged
        (over ranks too with sync_dist); publish them and return what goes to the logger. Every rank must call
        this; when `some_rank_idle` (a rank sat out evaluation steps, so may have logged nothing) the ranks first
        agree on what they logged (`module`: where such a rank finds the metric objects)."""
        values = self._epoch.pop(self.stage, {})
        metrics = self._metrics.pop(self.stage, {})
        results = self._computed.pop(self.stage, {})
        if some_rank_idle:
            agree_on_entries(values, metrics, module, self.gather, _synced_placeholder)
        results.update(compute(metrics, results, self.data_parallel_group()))
        reset(metrics)
        results.update(self._reduced(values))
        out = {}
        for name in sorted(results):
            value, prog_bar, to_logger = results[name]
            published = self._epoch_name(name)
            self._publish(published, value, prog_bar)
            if to_logger:
                out[published] = float(value)
        self.at_epoch_end = False
        return out

    def _epoch_name(self, name: str) -> str:
        return f"{name}_epoch" if f"{name}_step" in self.callback_metrics else name

    def _reduced(self, values: dict[str, _EpochValue]) -> dict[str, tuple[torch.Tensor, bool, bool]]:
        """Each epoch value, over the ranks too where synced: the synced values of all names travel in one
        all-reduce per kind of reduction, in sorted order (the same on every rank)."""
        names = sorted(values)
        sums = {n: (values[n].total, values[n].weight) for n in names}
        for op in ("sum", "max", "min"):  # one all-reduce per kind of reduction in use, in a fixed order
            synced = [n for n in names if values[n].sync_dist and _op(values[n].reduce_fx) == op]
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
        return {
            n: (torch.tensor(values[n].result(*(float(x) for x in sums[n]))), values[n].prog_bar, values[n].to_logger)
            for n in names
        }

    def forget_published(self) -> None:
        """Drop what was published (after the sanity check, whose values are not the run's)."""
        self.callback_metrics.clear()
        self.progress_bar_metrics.clear()
        self.step_metrics.clear()


def _synced_placeholder(reduce_fx: str, prog_bar: bool, to_logger: bool) -> _EpochValue:
    """The entry of a synced value this rank did not log (it ran no step): it adds nothing to the reduction."""
    return _EpochValue(reduce_fx, torch.tensor(_START[reduce_fx], dtype=torch.float64), 0.0, True, prog_bar, to_logger)


def _op(reduce_fx: str) -> str:
    return "sum" if reduce_fx in ("mean", "sum") else reduce_fx
