"""Evaluation and prediction: each sample reaches the user's step once, on every rank alike (steps.py)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..data.loaders import limit_batches
from ..module import TrainModule
from ..state import move_to_device
from .pipeline_steps import evaluation_step
from .steps import run_steps

if TYPE_CHECKING:
    from ..trainer import Trainer


def to_step(trainer: Trainer, batch: Any) -> Any:
    """The batch on the device in the precision's dtype; its size weighs the step's logged values."""
    batch = trainer.precision.convert_input(move_to_device(batch, trainer.strategy.root_device))
    trainer.metrics.start_step(batch)
    if trainer.strategy.context_parallel is None:
        return batch
    dims = trainer.module.sequence_dims(batch) if isinstance(trainer.module, TrainModule) else None
    return trainer.strategy.split_sequence(batch, dims)  # this rank's part of each sequence


def log_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    if metrics and trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, step=trainer.global_step)


def unless_undefined(trainer: Trainer, module: Any, val_loader: Any) -> Any:
    """fit's validation loader, or None when the module defines no validation_step: it trains without validation,
    as in Lightning, said once on rank 0 (and `trainer.skipped_validation` says why, for the monitors)."""
    if val_loader is None or type(module).validation_step is not TrainModule.validation_step:
        return val_loader
    trainer.skipped_validation = f"{type(module).__name__} defines no validation_step"
    if trainer.is_global_zero:
        warnings.warn(
            f"validation is skipped: {trainer.skipped_validation}, so the validation DataLoader given "
            "(by fit's arguments, a datamodule or the module) is not used",
            stacklevel=3,
        )
    return None


def evaluate(trainer: Trainer, loader: Any, stage: str, limit: int | None = None, log: bool = True) -> dict[str, float]:
    """One pass of validation or test; returns the epoch metrics. The epoch-end hooks run before the epoch's
    metrics are closed, so what they log belongs to this epoch, and after the logged metric objects are computed
    (as Lightning orders them)."""
    t, module = trainer, trainer.module
    name = "validation" if stage == "validate" else "test"
    if limit is None:
        argument = "limit_val_batches" if stage == "validate" else "limit_test_batches"
        limit = limit_batches(loader, getattr(t, argument), argument)
        t.num_val_batches = limit
    step_fn = module.validation_step if stage == "validate" else module.test_step
    module.eval()
    t.metrics.stage = stage
    t._call(f"on_{name}_start")
    t._call(f"on_{name}_epoch_start")

    def step(batch: Any, batch_idx: int) -> None:
        batch = to_step(t, batch)
        output = _run_step(t, step_fn, batch, batch_idx)
        t._call(f"on_{name}_batch_end", output, batch, batch_idx)

    with torch.no_grad():
        some_rank_idle = run_steps(t, loader, limit, stage, step)
    t.metrics.start_epoch_end(module, some_rank_idle)  # the metric objects computed first, as in Lightning
    t._call(f"on_{name}_epoch_end")
    metrics = t.metrics.end_epoch(module, some_rank_idle)
    if log:
        log_metrics(t, metrics)
    t._call(f"on_{name}_end")
    return metrics


def _run_step(trainer: Trainer, step_fn: Any, batch: Any, batch_idx: int) -> Any:
    """An evaluation step method on a batch (through the stages under pipeline parallel)."""
    with trainer.precision.autocast():
        if trainer.strategy.pipeline is not None:
            return evaluation_step(trainer.strategy, trainer.module, step_fn, batch, batch_idx)
        with trainer.strategy.forward_context():
            return step_fn(batch, batch_idx)


def predict(trainer: Trainer, loader: Any) -> list[Any] | None:
    """Each batch's prediction, in dataset order on rank 0 (loaders split by ShardBatchSampler); None elsewhere."""
    t, module, strategy = trainer, trainer.module, trainer.strategy
    module.eval()
    t.metrics.stage = "predict"
    t._call("on_predict_start")
    predictions = []

    def step(batch: Any, batch_idx: int) -> None:
        batch = to_step(t, batch)
        prediction = _run_step(t, module.predict_step, batch, batch_idx)
        prediction = strategy.join_sequence_parts(prediction)  # (whole sequences under context parallel)
        predictions.append(prediction)
        t._call("on_predict_batch_end", prediction, batch, batch_idx)

    with torch.no_grad():
        run_steps(t, loader, 2**62, "predict", step)
    t._call("on_predict_end")
    if not strategy.distributed:
        return predictions
    every = strategy.all_gather_object(predictions)  # one rank per data-parallel rank: a tp/cp group's are alike,
    by_rank = [every[r] for r in strategy.data_parallel_representatives()]  # a pipeline's last stage predicts
    return [prediction for ranks in by_rank for prediction in ranks] if t.is_global_zero else None
