"""ThroughputMonitor (Lightning's name): samples, items (e.g. tokens) and FLOPs per second, logged every
`log_every_n_steps` optimizer steps, per rank (`device/...`) and for all ranks together.

The FLOPs of one training batch (forward and backward, this rank) are counted once, on the first batch, with
`torch.utils.flop_counter.FlopCounterMode` (matrix products, convolutions and attention: the operations that
dominate); every later batch is taken to cost the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainModule


def leading_dimension(batch: Any) -> int:
    """The batch size of a tensor or of the first tensor in a (nested) list, tuple or dict."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        try:
            return leading_dimension(value)
        except ValueError:
            continue
    raise ValueError("ThroughputMonitor: no tensor in the batch to count samples by; give batch_size_fn")


class ThroughputMonitor(Callback):
    """Logs samples, items (e.g. tokens) and FLOPs per second during training (Lightning's name).

    The values are logged to the loggers every `log_every_n_steps` optimizer steps: this rank's (`device/...`)
    and, for all ranks, this rank's times the world size. The FLOPs of one training batch (forward and backward,
    this rank) are counted once, on the first batch, with `torch.utils.flop_counter.FlopCounterMode`; every later
    batch is taken to cost the same.

    Args:
        batch_size_fn: `batch -> int`, the samples in a batch; `None` for the leading dimension of the batch's
            first tensor.
        length_fn: `batch -> int`, the items in a batch (e.g. tokens), logged as `items_per_sec`; `None` to not
            count items.
        available_flops: one rank's peak FLOP/s, to log the model FLOPs utilization as `device/mfu`; `None` to
            not log it.

    Raises:
        TypeError: if `batch_size_fn` or `length_fn` is given and not callable.
        ValueError: during training, without `batch_size_fn`, if a batch holds no tensor.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        available_flops: float | None = None,
    ) -> None:
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ThroughputMonitor: {name} must be a callable (batch) -> int, got {fn!r}")
        self.batch_size_fn = batch_size_fn or leading_dimension
        self.length_fn = length_fn
        self.available_flops = available_flops
        self.flops_per_batch: int | None = None
        self._counter: Any = None  # a torch.utils.flop_counter.FlopCounterMode while the first batch runs
        self._logged_at = 0  # the global step last logged
        self._reset_window()

    def _reset_window(self) -> None:
        self._start, self._batches, self._samples, self._items = None, 0, 0, 0

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()
        if self.flops_per_batch is None and self._counter is None:
            from torch.utils.flop_counter import FlopCounterMode  # here: it imports triton, ~0.4 s per process

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops_per_batch = self._counter.get_total_flops()
            self._counter = None
        self._batches += 1
        self._samples += int(self.batch_size_fn(batch))
        self._items += int(self.length_fn(batch)) if self.length_fn else 0
        step = trainer.global_step
        if step != self._logged_at and step % trainer.log_every_n_steps == 0:
            self._logged_at = step
            self._log(trainer)

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _log(self, trainer: Trainer) -> None:
        elapsed = time.perf_counter() - self._start
        per_device = {"batches_per_sec": self._batches / elapsed, "samples_per_sec": self._samples / elapsed}
        if self.length_fn:
            per_device["items_per_sec"] = self._items / elapsed
        if self.flops_per_batch:
            per_device["flops_per_sec"] = self.flops_per_batch * self._batches / elapsed
            if self.available_flops:
                per_device["mfu"] = per_device["flops_per_sec"] / self.available_flops
        metrics = {f"device/{k}": v for k, v in per_device.items()}
        metrics.update({k: v * trainer.world_size for k, v in per_device.items() if k != "mfu"})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self.last_metrics = metrics
        self._reset_window()
