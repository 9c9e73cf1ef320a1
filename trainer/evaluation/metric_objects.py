"""Metric objects given to `self.log`, as Lightning takes them: torchmetrics' `Metric`, recognised by its interface
(update, compute, reset), so torchmetrics is not a dependency.

`self.log(name, metric)`: on a step the value of the batch (what calling the metric returned), at the epoch's end
`compute()`, which syncs the metric's states across ranks by itself (so `sync_dist` adds nothing), then `reset()`.
As in Lightning, the metrics logged in the steps are computed before the epoch-end hook (they are in
`trainer.callback_metrics` there), so a module that resets them in that hook still logs their epoch value.
`self.log_dict(collection)` logs each metric of a `MetricCollection` so. The states are attributes of the metric,
a submodule of the TrainModule: they move with it to the strategy's device and are never sharded (no parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

METRIC_METHODS = ("update", "compute", "reset")


def is_metric(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and all(callable(getattr(value, m, None)) for m in METRIC_METHODS)


def is_collection(value: Any) -> bool:
    """A MetricCollection: a metric that is also a mapping of metrics."""
    return is_metric(value) and callable(getattr(value, "items", None))


def collection_items(collection: Any) -> Any:
    """Its (name, metric) pairs, as Lightning's log_dict takes them: without the compute groups' base metrics,
    members sharing their group's states (each member's compute() then sees them)."""
    try:
        return collection.items(keep_base=False, copy_state=False)
    except TypeError:  # a mapping of metrics that takes no such arguments
        return collection.items()


@dataclass
class EpochMetric:
    metric: Any
    prog_bar: bool = False
    to_logger: bool = True
    on_epoch: bool = True  # otherwise it was logged per step only, and is only reset at the epoch's end


def step_value(name: str, metric: Any) -> torch.Tensor:
    """The metric's value for the running batch: what its last call (forward) returned."""
    if is_collection(metric):
        raise TypeError(
            f"self.log({name!r}): a {type(metric).__name__} holds several metrics; log it with "
            "self.log_dict(collection)"
        )
    value = getattr(metric, "_forward_cache", None)
    if value is None:
        raise ValueError(
            f"self.log({name!r}, metric, on_step=True): the metric has no value for this batch, as it was updated "
            "with metric.update(...); call it instead (metric(preds, target) updates it and returns the batch's "
            "value), or log it per epoch only"
        )
    return _scalar(name, value)


def compute(
    metrics: dict[str, EpochMetric], done: dict[str, Any], group: Any = None
) -> dict[str, tuple[torch.Tensor, bool, bool]]:
    """Each per-epoch metric's compute() in sorted order of names (a collective sync, so the same order on every
    rank), except those already in `done` (computed before the epoch-end hook, as Lightning computes them).
    `group`: the data-parallel ranks under tensor parallel, where a metric without a process group of its own
    syncs (the ranks of a tensor-parallel group saw the same samples: each is counted once)."""
    results = {}
    for name in sorted(n for n, entry in metrics.items() if entry.on_epoch and n not in done):
        entry = metrics[name]
        if group is not None and getattr(entry.metric, "process_group", "none of its own") is None:
            entry.metric.process_group = group
        results[name] = (_scalar(name, entry.metric.compute()), entry.prog_bar, entry.to_logger)
    return results


def reset(metrics: dict[str, EpochMetric]) -> None:
    """Every logged metric reset, once each."""
    for metric in {id(e.metric): e.metric for e in metrics.values()}.values():
        metric.reset()


def agree_on_entries(
    values: dict[str, Any],
    metrics: dict[str, EpochMetric],
    module: Any,
    gather: Callable[[Any], list[Any]],
    placeholder: Callable[..., Any],
) -> None:
    """Complete this rank's epoch entries with the collective ones any rank logged (synced values, metric
    objects), so that every rank takes part in the same reductions and compute() calls: after an evaluation in
    which some rank ran no step, that rank logged nothing. It finds a metric object by its attribute path in
    `module`; `placeholder(reduce_fx, prog_bar, to_logger)` is a synced value that adds nothing. Collective."""
    mine = {name: ("value", e.reduce_fx, e.prog_bar, e.to_logger) for name, e in values.items() if e.sync_dist}
    mine.update(
        {name: ("metric", _path(module, e.metric), e.prog_bar, e.to_logger, e.on_epoch) for name, e in metrics.items()}
    )
    everyone = gather(mine)
    for theirs in everyone:
        for name, (kind, *spec) in theirs.items():
            if kind == "metric" and spec[0] is None and any(name not in ranks for ranks in everyone):
                raise ValueError(
                    f"self.log({name!r}, metric): some rank ran no step of this epoch, and the metric is not a "
                    "submodule of the TrainModule (an attribute such as self.val_acc, or in an nn.ModuleDict), so "
                    "that rank cannot find it to compute it with the others"
                )
            if name in values or name in metrics:
                continue
            if kind == "value":
                values[name] = placeholder(*spec)
            else:
                metrics[name] = EpochMetric(module.get_submodule(spec[0]), *spec[1:])


def _path(module: Any, metric: Any) -> str | None:
    return next((name for name, m in module.named_modules() if m is metric), None) if module is not None else None


def _scalar(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    shape = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(f"self.log({name!r}, metric): the metric's value must be a scalar, got {shape}")
