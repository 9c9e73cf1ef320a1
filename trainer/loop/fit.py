"""The fit loop: epochs of training batches, with validation as `val_check_interval` says.

Trainer.fit -> StepRunner.fit -> train_epoch -> TrainingBatch.run (batch.py) -> training_step. An epoch's
batches start after the batches trained before a mid-epoch resume (trainer/data/epoch_batches.py); validation runs
when it is due (validation.py). Evaluation runs the same number of steps on every rank although ranks may hold
different numbers of batches (trainer/evaluation/steps.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch.distributed as dist

from callbacks import EarlyStopping, ModelCheckpoint, ProgressBar

from ..data.epoch_batches import epoch_batches
from ..data.loaders import set_epoch
from ..data.stream_check import warn_if_unsplit
from ..data.uneven import report_unused
from ..evaluation.evaluate import log_metrics
from ..launch import preemption
from .agreement import Agreement
from .batch import TrainingBatch, TrainingClock
from .optimizers import step_schedulers
from .validation import check_val_check_interval, sanity_check, validate, validation_due

if TYPE_CHECKING:
    from ..data.fit_data import FitLoaders
    from ..trainer import Trainer

READ_EPOCH_METRICS = (ModelCheckpoint, EarlyStopping, ProgressBar)  # their on_train_epoch_end comes after the metrics


class StepRunner:
    """Runs fit: its epochs, each epoch's training batches (one `TrainingBatch` after another) and validation."""

    def __init__(self, trainer: Trainer, loaders: FitLoaders) -> None:
        self.trainer, self.strategy, self.module = trainer, trainer.strategy, trainer.module
        self.loaders = loaders  # built when first used, in Lightning's order (trainer/data/fit_data.py)
        self.clock = TrainingClock()
        self.batch = TrainingBatch(trainer, self.clock)  # one training batch, and the optimizer step
        # whether the first step compared the ranks' first batches (trainer/data/stream_check.py)
        self._stream_checked = False

    train_loader = property(lambda self: self.loaders.train)
    val_loader = property(lambda self: self.loaders.val)

    # ---- fit ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        t = self.trainer
        self._log_start()
        t._call("on_fit_start")
        sanity_check(t, self.loaders)  # the validation loader is built here when there is a sanity check
        self.loaders.train  # noqa: B018  (then the training loader, then the validation loader: Lightning's order)
        self.loaders.val  # noqa: B018
        check_val_check_interval(t, self.train_loader, self.val_loader)
        t._call("on_train_start")
        t.timer.start()
        self.clock.start(t.state.time_elapsed)
        while not self._finished():
            self.train_epoch()
        if self.batch.out_of_time and t.is_global_zero:
            print(
                f"[trainer] max_time={t.max_time} reached: every rank stopped after global step {t.global_step}",
                flush=True,
            )
        if self.strategy.reduce_boolean_decision(t.signal_watch.received is not None, all=False):
            raise self._preempt()  # the signal came after the last step (in the last validation, say)
        t._call("on_train_end")
        t._call("on_fit_end")
        for logger in t.loggers:
            logger.finalize("success")

    def _log_start(self) -> None:
        t = self.trainer
        for logger in t.loggers:
            logger.log_hyperparams(dict(self.module.hparams))
        self._log_memory()

    def _log_memory(self) -> None:
        """Every rank's memory report (memory/rank<r>/<kind>_MiB, and memory/rank<r>/trainable_elements), at the
        start and at each epoch's end."""
        t = self.trainer
        if not t.loggers:  # the same on every rank: nothing to gather for
            return
        reports = self.strategy.all_gather_object(self.strategy.memory_report())
        metrics = dict(_memory_metric(r, k, v) for r, report in enumerate(reports) for k, v in report.items())
        if t.is_global_zero:
            for logger in t.loggers:
                logger.log_metrics(metrics, step=t.global_step)

    def _finished(self) -> bool:
        t = self.trainer
        if t.should_stop or self.batch.out_of_time or (t.max_steps > 0 and t.global_step >= t.max_steps):
            return True
        return t.max_epochs > 0 and t.current_epoch >= t.max_epochs

    def train_epoch(self) -> None:
        t, step = self.trainer, self.batch
        self.module.train()
        t.metrics.stage = "train"
        set_epoch(self.train_loader, t.current_epoch)
        t._call("on_train_epoch_start")
        step.batches, batches, empty = epoch_batches(t, self.train_loader, t.state.batches_done_in_epoch)
        step.agreed = Agreement(last_batch=empty)
        for batch_idx, batch in batches:
            if batch_idx >= t.num_training_batches:
                break
            if not self._stream_checked:  # the first step only
                self._stream_checked = True
                warn_if_unsplit(self.strategy, self.train_loader, batch)
            with self._naming_the_step(batch_idx):
                step.run(batch, batch_idx)
                if validation_due(t, self.val_loader, batch_idx, step.agreed.last_batch):
                    self._close_training_steps(batch_idx)
                    with t.timer.phase("validation"):
                        validate(t, self.val_loader)
            if step.stop_requested:
                raise self._preempt()
            limit = step.out_of_time or (t.max_steps > 0 and t.global_step >= t.max_steps)
            if limit and batch_idx + 1 < t.num_training_batches:
                return  # stopped inside the epoch: it is not over, and a resume continues it at the next batch
            if t.should_stop or limit or step.agreed.last_batch:
                break
        if step.agreed.last_batch and self.strategy.distributed:
            report_unused(step.batches, self.strategy, t.current_epoch, t.state.batches_done_in_epoch)
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

    def _close_training_steps(self, batch_idx: int) -> None:
        """Before the validation that follows the epoch's last training batch: the epoch values of its training
        steps are complete, so they are published for what reads them after validation (ModelCheckpoint,
        EarlyStopping); what on_train_epoch_end logs is published at the epoch's end, at the same step."""
        if batch_idx + 1 == self.trainer.num_training_batches or self.batch.agreed.last_batch:
            log_metrics(self.trainer, self.trainer.metrics.end_epoch())

    def _end_train_epoch(self) -> None:
        """The module's and most callbacks' on_train_epoch_end first, so that what they log belongs to this epoch;
        then the epoch's metrics; then the callbacks that read them (as Lightning orders them)."""
        t = self.trainer
        readers = [cb for cb in t.callbacks if isinstance(cb, READ_EPOCH_METRICS)]
        t.metrics.start_epoch_end()
        t._call("on_train_epoch_end", skip=readers)
        log_metrics(t, t.metrics.end_epoch())
        t._call_callbacks(readers, "on_train_epoch_end")
        self._log_memory()
        if self.module.automatic_optimization:  # under manual optimization the user steps the schedulers
            step_schedulers(t, "epoch", t.current_epoch + 1)
        t.state.epoch += 1
        t.state.batches_done_in_epoch, t.state.epoch_complete = 0, False
        t.should_stop = self.strategy.reduce_boolean_decision(t.should_stop, all=False)

    def _preempt(self) -> preemption.Preempted:
        """Save `<checkpoint dir>/preempted` (every rank) and return the exception that ends fit."""
        t = self.trainer
        path = os.path.join(t._checkpoint_dirs()[0], "preempted")
        t.save_checkpoint(path)
        return preemption.stop(t.global_rank, t.signal_watch.received or signal.SIGTERM, t.global_step, path)


def _memory_metric(rank: int, kind: str, value: int) -> tuple[str, float]:
    """A memory report's entry as a logged metric: bytes in MiB, counts of elements as they are."""
    if kind.endswith("_elements"):
        return f"memory/rank{rank}/{kind}", value
    return f"memory/rank{rank}/{kind}_MiB", value / 2**20
