"""The module's steps under pipeline parallel, where only the last stage has the model's output.

Training: `pipeline_loss` runs on the last stage once per micro-batch, so its `self.log` calls are recorded there,
reduced over the micro-batches (the mean of equal micro-batches is the batch's mean, as one process logs it) and
logged on every rank of the pipeline once the last stage has sent them.

Validation, test and predict: the batch's inputs run forward through the stages; on the last stage the step method
runs with the module's forward standing in for the whole pipeline (`self(inputs)` returns the pipeline's output),
and what it logs and returns is sent to every rank of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..state import move_to_device

_LOG_ARGUMENTS = ("prog_bar", "on_step", "on_epoch", "sync_dist", "batch_size", "reduce_fx", "logger", "rank_zero_only")
Record = tuple[str, torch.Tensor, dict[str, Any]]  # name, value, the other arguments of self.log


@contextmanager
def recorded_logs(module: Any) -> Iterator[list[Record]]:
    """Inside, `module.log(name, value, ...)` records the call instead of logging."""
    records: list[Record] = []

    def record(name: str, value: Any, *args: Any, **options: Any) -> None:
        options.update(zip(_LOG_ARGUMENTS, args))
        value = value.detach().float().cpu() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        records.append((name, value, options))

    module.log = record
    try:
        yield records
    finally:
        del module.log


def per_step(records: list[Record]) -> list[Record]:
    """The micro-batches' records of each name made one: the mean (or sum, max, min: the name's `reduce_fx`)."""
    by_name: dict[str, list[Record]] = {}
    for entry in records:
        by_name.setdefault(entry[0], []).append(entry)
    out = []
    for name, entries in by_name.items():
        options = entries[-1][2]
        values = torch.stack([value.reshape(()) for _, value, _ in entries])
        fx = getattr(options.get("reduce_fx", "mean"), "__name__", options.get("reduce_fx", "mean"))
        reduced = {"sum": values.sum, "max": values.max, "min": values.min}.get(fx, values.mean)()
        out.append((name, reduced, options))
    return out


def log_all(module: Any, records: list[Record]) -> None:
    for name, value, options in records:
        module.log(name, value, **options)


def evaluation_step(strategy: Any, module: Any, step: Callable[[Any, int], Any], batch: Any, batch_idx: int) -> Any:
    """`step(batch, batch_idx)` (validation_step, test_step, predict_step) with the pipeline's output: run on the
    last stage, its logged values and its result given to every rank of the pipeline. Collective over it."""
    output = strategy.pipeline_forward(batch)
    result, records = None, []
    if output is not None:  # the last stage
        with recorded_logs(module) as records, _standing_in(module, output):
            result = step(batch, batch_idx)
    result, logged = strategy.from_last_stage((result, per_step(records)))
    log_all(module, logged)
    return move_to_device(result, strategy.root_device)


@contextmanager
def _standing_in(module: Any, output: Any) -> Iterator[None]:
    """Inside, calling the module returns `output` (what the pipeline computed of the batch's inputs)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return output

    module.forward = forward
    try:
        yield
    finally:
        del module.forward
