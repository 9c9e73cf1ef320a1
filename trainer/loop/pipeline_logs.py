"""What a module logs under pipeline parallel: `pipeline_loss` runs on the last stage once per micro-batch, so its
`self.log` calls are recorded there, reduced over the micro-batches (the mean of equal micro-batches is the batch's
mean, as one process logs it) and logged on every rank of the pipeline once the last stage has sent them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

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
