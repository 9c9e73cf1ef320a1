"""The loops: fit (epochs of training batches with validation), evaluation and prediction.

One training batch reads as plain torch: `training_step`, `loss.backward()`, clipping, `optimizer.step()`,
`optimizer.zero_grad()`, with the callback hooks between; the strategy's engine works from hooks on the model and
the optimizer. Trainer.fit -> StepRunner.fit -> train_epoch -> train_batch -> training_step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .data import limit_batches, set_epoch
from .optimizers import step_schedulers
from .seed import rng_state, set_rng_state
from .state import move_to_device

if TYPE_CHECKING:
    from .trainer import Trainer


class StepRunner:
    def __init__(self, trainer: Trainer, train_loader: Any, val_loader: Any) -> None:
        self.trainer, self.strategy, self.module = trainer, trainer.strategy, trainer.module
        self.train_loader, self.val_loader = train_loader, val_loader
        self.optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._backward_in_window = False

    # ---- fit ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        t = self.trainer
        t.num_training_batches = limit_batches(
            self.train_loader, t.limit_train_batches, "limit_train_batches"
        )
        if self.val_loader is not None:
            t.num_val_batches = limit_batches(self.val_loader, t.limit_val_batches, "limit_val_batches")
        self._log_start()
        t._call("on_fit_start")
        t._call("on_train_start")
        while not self._finished():
            self.train_epoch()
        t._call("on_train_end")
        t._call("on_fit_end")
        if t.logger is not None:
            t.logger.finalize("success")

    def _log_start(self) -> None:
        t = self.trainer
        if t.logger is None:
            return
        t.logger.log_hyperparams(dict(self.module.hparams))
        report = self.strategy.memory_report()
        t.logger.log_metrics({f"memory/{k}_MiB": v / 2**20 for k, v in report.items()}, step=t.global_step)

    def _finished(self) -> bool:
        t = self.trainer
        if t.should_stop or (t.max_steps > 0 and t.global_step >= t.max_steps):
            return True
        return t.max_epochs > 0 and t.current_epoch >= t.max_epochs

    def train_epoch(self) -> None:
        t = self.trainer
        self.module.train()
        t.metrics.stage = "train"
        set_epoch(self.train_loader, t.current_epoch)
        t._call("on_train_epoch_start")
        skip = t.state.batches_done_in_epoch  # batches already trained before a mid-epoch resume
        resume_rng = rng_state() if skip else None  # the checkpoint's; starting the loader and skipping draw
        for batch_idx, batch in enumerate(self.train_loader):
            if batch_idx >= t.num_training_batches:
                break
            if batch_idx < skip:
                if batch_idx == skip - 1:
                    set_rng_state(resume_rng)
                continue
            with self._naming_the_step(batch_idx):
                self.train_batch(batch, batch_idx)
                if self._validation_due(batch_idx):
                    self.validate()
            if t.max_steps > 0 and t.global_step >= t.max_steps and batch_idx + 1 < t.num_training_batches:
                return  # stopped inside the epoch: it is not over, and a resume continues it at the next batch
            if t.should_stop or (t.max_steps > 0 and t.global_step >= t.max_steps):
                break
        self._end_train_epoch()

    @contextmanager
    def _naming_the_step(self, batch_idx: int) -> Iterator[None]:
        """Say where training was when a collective failed (gloo raises plain RuntimeErrors, nccl DistErrors;
        subclasses such as torch.OutOfMemoryError pass unchanged)."""
        try:
            yield
        except RuntimeError as error:
            collective = type(error) is RuntimeError or isinstance(error, dist.DistError)
            if not collective or not self.strategy.distributed:
                raise
            t = self.trainer
            raise type(error)(
                f"rank {t.global_rank} failed at global step {t.global_step}, epoch {t.current_epoch}, "
                f"batch {batch_idx}: {error}"
            ) from error

    def _end_train_epoch(self) -> None:
        t = self.trainer
        epoch_metrics = t.metrics.end_epoch()
        self._log(epoch_metrics)
        t._call("on_train_epoch_end")
        step_schedulers(t, "epoch", t.current_epoch + 1)
        t.state.epoch += 1
        t.state.batches_done_in_epoch = 0
        t.should_stop = self.strategy.reduce_boolean_decision(t.should_stop, all=False)

    def _validation_due(self, batch_idx: int) -> bool:
        t = self.trainer
        if self.val_loader is None or t.num_val_batches == 0:
            return False
        if (t.current_epoch + 1) % t.check_val_every_n_epoch != 0:
            return False
        interval = t.val_check_interval
        if isinstance(interval, float):
            every = max(1, int(t.num_training_batches * interval))
            return (batch_idx + 1) % every == 0 or (
                interval == 1.0 and batch_idx + 1 == t.num_training_batches
            )
        return (batch_idx + 1) % interval == 0

    # ---- one training batch -------------------------------------------------------------------------
    def train_batch(self, batch: Any, batch_idx: int) -> None:
        t = self.trainer
        batch = move_to_device(batch, self.strategy.root_device)
        t._call("on_train_batch_start", batch, batch_idx)
        window_end = (
            batch_idx + 1
        ) % t.accumulate_grad_batches == 0 or batch_idx + 1 == t.num_training_batches
        with t.precision.autocast(), self.strategy.forward_context():
            output = self.module.training_step(batch, batch_idx)
        loss = self._loss_from(output, batch_idx)
        if self._all_ranks_skip(loss is None, batch_idx):
            outputs = None
        else:
            with self.strategy.no_backward_sync(enabled=not window_end):
                t.precision.scale_loss(loss / t.accumulate_grad_batches).backward()
            self._backward_in_window = True
            outputs = {"loss": loss.detach()}
        if window_end:
            self._optimizer_step()
        t.state.batches_done_in_epoch = batch_idx + 1  # before the hook: a checkpoint saved there resumes after it
        t._call("on_train_batch_end", outputs, batch, batch_idx)

    def _loss_from(self, output: Any, batch_idx: int) -> torch.Tensor | None:
        loss = output["loss"] if isinstance(output, dict) and "loss" in output else output
        if loss is None:
            return None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise TypeError(
                f"training_step (batch {batch_idx}) must return a scalar loss tensor that requires grad, a dict "
                f"with a 'loss' entry, or None to skip the batch; got {_describe(output)}"
            )
        return loss.reshape(())

    def _all_ranks_skip(self, skip: bool, batch_idx: int) -> bool:
        """Skipping a batch must be unanimous: a lone skip would leave the other ranks waiting in backward."""
        if not self.strategy.distributed:
            return skip
        # One small all-reduce per batch; the ranks are named only in the (rare) case of disagreement.
        skipping_ranks = int(self.strategy.all_reduce(torch.tensor(float(skip)), op="sum").item())
        if skipping_ranks in (0, self.strategy.world_size):
            return skip
        flags = self.strategy.all_gather_object(skip)
        skipping = [rank for rank, f in enumerate(flags) if f]
        raise RuntimeError(
            f"training_step returned None on rank(s) {skipping} but not on the others at epoch "
            f"{self.trainer.current_epoch}, batch {batch_idx}; every rank must skip the same batch"
        )

    def _optimizer_step(self) -> None:
        t = self.trainer
        if not self._backward_in_window:
            return
        self._backward_in_window = False
        any_rank = lambda flag: self.strategy.reduce_boolean_decision(flag, all=False)  # noqa: E731
        if t.precision.unscale_and_check(self.strategy.gradients(), any_rank):
            if t.gradient_clip_val is not None:
                self.strategy.clip_gradients(t.gradient_clip_val)
            t._call("on_before_optimizer_step", self.optimizer)
            self.optimizer.step()
        self.optimizer.zero_grad()
        t.state.global_step += 1
        step_schedulers(t, "step", t.global_step)
        step_metrics = t.metrics.pop_step_metrics()
        if t.global_step % t.log_every_n_steps == 0:
            self._log(step_metrics)

    def _log(self, metrics: dict[str, float]) -> None:
        t = self.trainer
        if metrics and t.logger is not None and t.is_global_zero:
            t.logger.log_metrics({**metrics, "epoch": t.current_epoch}, step=t.global_step)

    # ---- evaluation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        t = self.trainer
        self.evaluate(self.val_loader, "validate", limit=t.num_val_batches)
        self.module.train()
        t.metrics.stage = "train"

    def evaluate(self, loader: Any, stage: str, limit: int | None = None) -> dict[str, float]:
        t = self.trainer
        name = "validation" if stage == "validate" else "test"
        if limit is None:
            argument = "limit_val_batches" if stage == "validate" else "limit_test_batches"
            limit = limit_batches(loader, getattr(t, argument), argument)
            t.num_val_batches = limit
        step_fn = self.module.validation_step if stage == "validate" else self.module.test_step
        self.module.eval()
        t.metrics.stage = stage
        t._call(f"on_{name}_start")
        t._call(f"on_{name}_epoch_start")
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                batch = move_to_device(batch, self.strategy.root_device)
                with t.precision.autocast(), self.strategy.forward_context():
                    output = step_fn(batch, batch_idx)
                t._call(f"on_{name}_batch_end", output, batch, batch_idx)
        metrics = t.metrics.end_epoch()
        self._log(metrics)
        t._call(f"on_{name}_epoch_end")
        t._call(f"on_{name}_end")
        return metrics

    def predict(self, loader: Any) -> list[Any]:
        t = self.trainer
        self.module.eval()
        t.metrics.stage = "predict"
        t._call("on_predict_start")
        predictions = []
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                batch = move_to_device(batch, self.strategy.root_device)
                with t.precision.autocast(), self.strategy.forward_context():
                    prediction = self.module.predict_step(batch, batch_idx)
                predictions.append(prediction)
                t._call("on_predict_batch_end", prediction, batch, batch_idx)
        t._call("on_predict_end")
        return predictions


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
    return type(value).__name__
