"""The loops: fit (epochs of training batches with validation), evaluation and prediction.

One training batch reads as plain torch: `training_step`, `loss.backward()`, clipping, `optimizer.step()`,
`optimizer.zero_grad()`, with the callback hooks between; the strategy's engine works from hooks on the model and
the optimizer. Trainer.fit -> StepRunner.fit -> train_epoch -> train_batch -> training_step.

After each training_step the ranks agree, in one small all-reduce (agreement.py), on what only some of them may
know: a skipped batch, a non-finite loss, a SIGTERM, training data that ran out. Evaluation runs the same number of
steps on every rank although ranks may hold different numbers of batches (uneven.py).
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from callbacks import EarlyStopping, ModelCheckpoint, ProgressBar

from ..data.loaders import loader_length, set_epoch
from ..data.resume_sampler import start_at_batch
from ..data.stream_check import warn_if_unsplit
from ..data.uneven import Lookahead, report_unused
from ..evaluation.evaluate import evaluate, log_metrics, to_step
from ..launch import preemption
from ..seed import rng_state, set_rng_state
from .agreement import Agreement, agree
from .nonfinite import nonfinite_losses
from .optimizers import step_schedulers

if TYPE_CHECKING:
    from ..data.fit_data import FitLoaders
    from ..trainer import Trainer

READ_EPOCH_METRICS = (ModelCheckpoint, EarlyStopping, ProgressBar)  # their on_train_epoch_end comes after the metrics


class StepRunner:
    def __init__(self, trainer: Trainer, loaders: FitLoaders) -> None:
        self.trainer, self.strategy, self.module = trainer, trainer.strategy, trainer.module
        self.loaders = loaders  # built when first used, in Lightning's order (fit_data.py)
        self.optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._backward_in_window = False
        self._unsynced = False  # the window's gradients await the reduction no_sync held back
        self._skip_window = False  # a non-finite loss in this accumulation window (on_nonfinite="skip")
        self._stop_requested = False  # the ranks agreed to stop on a signal; this optimizer step is done
        self._out_of_time = False  # the ranks agreed that max_time has passed; this optimizer step is done
        self._clock: tuple[float, float] = (0.0, 0.0)  # (time_elapsed before this fit, when its training started)
        self.agreed = Agreement()  # the ranks' agreement after the latest training_step
        self._batches: Any = None  # this epoch's training batches
        self._stream_checked = False  # whether the first step compared the ranks' first batches (stream_check.py)

    train_loader = property(lambda self: self.loaders.train)
    val_loader = property(lambda self: self.loaders.val)

    # ---- fit ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        t = self.trainer
        self._log_start()
        t._call("on_fit_start")
        self._sanity_check()  # the validation loader is built here when there is a sanity check
        self.loaders.train  # noqa: B018  (then the training loader, then the validation loader: Lightning's order)
        self.loaders.val  # noqa: B018
        self._check_val_check_interval()
        t._call("on_train_start")
        t.timer.start()
        self._clock = (t.state.time_elapsed, time.monotonic())
        while not self._finished():
            self.train_epoch()
        if self._out_of_time and t.is_global_zero:
            print(f"[trainer] max_time={t.max_time} reached: every rank stopped after global step {t.global_step}",
                  flush=True)
        if self.strategy.reduce_boolean_decision(t.signal_watch.received is not None, all=False):
            raise self._preempt()  # the signal came after the last step (in the last validation, say)
        t._call("on_train_end")
        t._call("on_fit_end")
        for logger in t.loggers:
            logger.finalize("success")

    def _check_val_check_interval(self) -> None:
        """An interval that validation can never reach is a mistake, not a run without validation."""
        t = self.trainer
        interval, batches = t.val_check_interval, t.num_training_batches
        if self.val_loader is None or t.num_val_batches == 0:
            return
        sized = loader_length(self.train_loader) is not None
        if isinstance(interval, int) and sized and interval > batches:
            raise ValueError(
                f"val_check_interval={interval} is more than the {batches} training batch{'es' * (batches != 1)} of "
                f"an epoch, so validation would never run; use at most {batches}, a fraction of the epoch (a "
                "float), or limit_val_batches=0 to train without validation"
            )
        if isinstance(interval, float) and interval < 1.0 and not sized:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of the epoch, but the training loader has no "
                "length; give an int number of batches"
            )

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
        if t.should_stop or self._out_of_time or (t.max_steps > 0 and t.global_step >= t.max_steps):
            return True
        return t.max_epochs > 0 and t.current_epoch >= t.max_epochs

    def train_epoch(self) -> None:
        t = self.trainer
        self.module.train()
        t.metrics.stage = "train"
        set_epoch(self.train_loader, t.current_epoch)
        t._call("on_train_epoch_start")
        for batch_idx, batch in self._epoch_batches(t.state.batches_done_in_epoch):
            if batch_idx >= t.num_training_batches:
                break
            if not self._stream_checked:  # the first step only
                self._stream_checked = True
                warn_if_unsplit(self.strategy, self.train_loader, batch)
            with self._naming_the_step(batch_idx):
                self.train_batch(batch, batch_idx)
                if self._validation_due(batch_idx):
                    self._close_training_steps(batch_idx)
                    with t.timer.phase("validation"):
                        self.validate()
            if self._stop_requested:
                raise self._preempt()
            limit = self._out_of_time or (t.max_steps > 0 and t.global_step >= t.max_steps)
            if limit and batch_idx + 1 < t.num_training_batches:
                return  # stopped inside the epoch: it is not over, and a resume continues it at the next batch
            if t.should_stop or limit or self.agreed.last_batch:
                break
        if self.agreed.last_batch and self.strategy.distributed:
            report_unused(self._batches, self.strategy, t.current_epoch, t.state.batches_done_in_epoch)
        self._end_train_epoch()

    def _epoch_batches(self, skip: int) -> Iterator[tuple[int, Any]]:
        """(batch_idx, batch) of this epoch from batch `skip` on (the batches trained before a mid-epoch resume).
        The sampler the Trainer built starts there, and a loader that keeps its own state gets the checkpoint's
        (loader_state.py); the random state is the checkpoint's from the first batch on (making the iterator, and
        reading one batch ahead, draw from it). Any other loader has the skipped batches loaded and dropped."""
        self.agreed = Agreement()
        resume_rng = rng_state() if skip else None  # the checkpoint's
        position = self.trainer.loader_position
        restored = bool(skip) and position.restore()
        if loader_length(self.train_loader) is None:
            self._batches = self._looked_ahead()
            starts_there = restored
        else:
            starts_there = restored or (bool(skip) and start_at_batch(self.train_loader, skip))
            self._batches = iter(self.train_loader) if starts_there else self.train_loader
        if starts_there:
            set_rng_state(resume_rng)
            return enumerate(self._batches, start=skip)
        if skip:
            _warn_loading_skipped(self.train_loader, skip)
        return _skipping(enumerate(self._batches), skip, resume_rng)

    def _looked_ahead(self) -> Lookahead:
        """A loader without a length (an iterable dataset, whose ranks may run out at different times), looked
        ahead, so that each training_step's agreement says whether a rank ran out."""
        batches = Lookahead(self.train_loader, self.trainer.loader_position)
        if self.strategy.distributed and not self.strategy.reduce_boolean_decision(batches.has_next):
            batches.close()  # some rank has no batch at all: the epoch is empty on every rank
            self.agreed = Agreement(last_batch=True)
        return batches

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
        if batch_idx + 1 == self.trainer.num_training_batches or self.agreed.last_batch:
            self._log(self.trainer.metrics.end_epoch())

    def _end_train_epoch(self) -> None:
        """The module's and most callbacks' on_train_epoch_end first, so that what they log belongs to this epoch;
        then the epoch's metrics; then the callbacks that read them (as Lightning orders them)."""
        t = self.trainer
        readers = [cb for cb in t.callbacks if isinstance(cb, READ_EPOCH_METRICS)]
        t.metrics.start_epoch_end()
        t._call("on_train_epoch_end", skip=readers)
        self._log(t.metrics.end_epoch())
        t._call_callbacks(readers, "on_train_epoch_end")
        self._log_memory()
        if self.module.automatic_optimization:  # under manual optimization the user steps the schedulers
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
                interval == 1.0 and (batch_idx + 1 == t.num_training_batches or self.agreed.last_batch)
            )
        return (batch_idx + 1) % interval == 0

    # ---- one training batch -------------------------------------------------------------------------
    def train_batch(self, batch: Any, batch_idx: int) -> None:
        t = self.trainer
        batch = to_step(t, batch)
        t._call("on_train_batch_start", batch, batch_idx)
        with t.timer.phase("forward"), t.precision.autocast(), self.strategy.forward_context():
            output = self.module.training_step(batch, batch_idx)
        if not self.module.automatic_optimization:  # training_step did backward and the steps itself
            outputs = self._manual_outputs(output, batch_idx)
        else:
            loss = self._loss_from(output, batch_idx)
            agreed = self._agree(loss, batch_idx)
            window_end = (
                (batch_idx + 1) % t.accumulate_grad_batches == 0
                or batch_idx + 1 == t.num_training_batches
                or agreed.last_batch
            )
            if agreed.skip or self._skip_window:
                outputs = None
            else:
                with self.strategy.no_backward_sync(enabled=not window_end):
                    t.backward(loss / t.accumulate_grad_batches)
                self._backward_in_window = True
                self._unsynced = not window_end  # gradients held back by no_sync, not yet averaged
                outputs = {"loss": loss.detach()}
            if window_end:
                self._optimizer_step(batch_idx)
                self._stop_requested, self._out_of_time = agreed.stop, agreed.out_of_time
        t.state.batches_done_in_epoch = batch_idx + 1  # before the hook: a checkpoint saved there resumes after it
        t.state.time_elapsed = self._elapsed()
        t._call("on_train_batch_end", outputs, batch, batch_idx)

    def _manual_outputs(self, output: Any, batch_idx: int) -> Any:
        """Manual optimization: the ranks still agree on a signal or data that ran out; global_step counts the
        optimizer steps training_step took (trainer.py counts them)."""
        agreed = self._agree(None, batch_idx)  # no loss to check
        self._stop_requested, self._out_of_time = agreed.stop, agreed.out_of_time
        self._log_step_metrics()
        return output

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

    def _agree(self, loss: torch.Tensor | None, batch_idx: int) -> Agreement:
        """What every rank must know after this training_step (see agreement.py); a non-finite loss raises here
        with on_nonfinite="error", or marks this accumulation window to be skipped with "skip"."""
        t = self.trainer
        has_next = self._batches.has_next if isinstance(self._batches, Lookahead) else True
        stop = t.signal_watch.received is not None
        late = t.max_time is not None and self._elapsed() >= t.max_time.total_seconds()
        self.agreed = agree(self.strategy, loss, t.nonfinite.checks, stop, has_next, self._where(batch_idx), late)
        if self.agreed.nonfinite_loss and not self._skip_window:  # a window counts once
            self._nonfinite(f"loss ({nonfinite_losses(self.strategy, loss)})", batch_idx)
            self._skip_window = True
        return self.agreed

    def _elapsed(self) -> float:
        """Seconds trained, over resumes too (max_time counts them, as Lightning's Timer does)."""
        return self._clock[0] + time.monotonic() - self._clock[1]

    def _where(self, batch_idx: int) -> str:
        t = self.trainer
        return f"global step {t.global_step}, epoch {t.current_epoch}, batch {batch_idx}"

    def _nonfinite(self, what: str, batch_idx: int) -> None:
        t = self.trainer
        t.nonfinite.found(what, self._where(batch_idx), t.is_global_zero)

    def _optimizer_step(self, batch_idx: int) -> None:
        t = self.trainer
        if not (self._backward_in_window or self._skip_window):
            return
        stepping = not self._skip_window
        self._backward_in_window = self._skip_window = False
        with t.timer.phase("optimizer"):
            if self._unsynced:  # the window's last batch was skipped: its earlier backwards were never averaged
                self.strategy.synchronize_gradients()
                self._unsynced = False
            any_rank = lambda flag: self.strategy.reduce_boolean_decision(flag, all=False)  # noqa: E731
            if stepping and t.precision.unscale_and_check(self.strategy.gradients(), any_rank):
                t._call("on_before_optimizer_step", self.optimizer)  # before clipping, as Lightning
                if t.gradient_clip_val is not None:
                    stepping = self._clip_gradients(batch_idx)
                if stepping:
                    self.optimizer.step()
            t._call("on_before_zero_grad", self.optimizer)
            self.optimizer.zero_grad()
        t.state.global_step += 1
        step_schedulers(t, "step", t.global_step)
        self._log_step_metrics()

    def _log_step_metrics(self) -> None:
        t = self.trainer
        if t.nonfinite.skipped:
            t.metrics.record("skipped_nonfinite_steps", t.nonfinite.skipped)
        t.timer.end_step()
        if t.profiler is not None:
            t.profiler.step(t)
        step_metrics = t.metrics.pop_step_metrics()
        if t.global_step % t.log_every_n_steps == 0:
            self._log({**step_metrics, **t.timer.window_metrics()})  # time/*: where this window's steps went

    def _clip_gradients(self, batch_idx: int) -> bool:
        """Clip by the global norm; False to skip the step when that norm is not finite (on_nonfinite="skip").
        The norm is the same on every rank, so they all decide alike."""
        t = self.trainer
        norm = self.strategy.clip_gradients(t.gradient_clip_val, algorithm=t.gradient_clip_algorithm)
        if norm is not None and t.nonfinite.checks and not torch.isfinite(norm):
            self._nonfinite(f"gradient norm ({float(norm)}, over every rank)", batch_idx)
            return False
        return True

    def _preempt(self) -> preemption.Preempted:
        """Save `<checkpoint dir>/preempted` (every rank) and return the exception that ends fit."""
        t = self.trainer
        path = os.path.join(t._checkpoint_dirs()[0], "preempted")
        t.save_checkpoint(path)
        return preemption.stop(t.global_rank, t.signal_watch.received or signal.SIGTERM, t.global_step, path)

    def _log(self, metrics: dict[str, float]) -> None:
        log_metrics(self.trainer, metrics)

    def validate(self) -> None:
        t = self.trainer
        evaluate(t, self.val_loader, "validate", limit=t.num_val_batches)
        self.module.train()
        t.metrics.stage = "train"

    def _sanity_check(self) -> None:
        """A few validation batches before training (num_sanity_val_steps, as Lightning), so that a broken
        validation_step fails in seconds; nothing it logs is kept, and checkpoint callbacks ignore it. As in
        Lightning, the random state is put back afterwards: what the validation loader's hook and the batches drew
        from it does not change the training."""
        before = rng_state()
        try:
            self._sanity_steps()
        finally:
            set_rng_state(before)

    def _sanity_steps(self) -> None:
        t = self.trainer
        if t.num_sanity_val_steps == 0 or t.limit_val_batches == 0 or self.val_loader is None:
            return
        steps = t.num_val_batches if t.num_sanity_val_steps == -1 else min(t.num_sanity_val_steps, t.num_val_batches)
        if steps == 0:
            return
        t.sanity_checking = True
        t._call("on_sanity_check_start")
        evaluate(t, self.val_loader, "validate", limit=steps, log=False)
        t._call("on_sanity_check_end")
        t.sanity_checking = False
        t.metrics.forget_published()
        self.module.train()
        t.metrics.stage = "train"

def _skipping(batches: Iterator[tuple[int, Any]], skip: int, resume_rng: dict | None) -> Iterator[tuple[int, Any]]:
    """`batches` from batch `skip` on, the skipped ones loaded and dropped; the random state is set back to the
    checkpoint's once they are (loading them drew from it)."""
    for batch_idx, batch in batches:
        if batch_idx < skip:
            if batch_idx == skip - 1:
                set_rng_state(resume_rng)
            continue
        yield batch_idx, batch


def _warn_loading_skipped(loader: Any, skip: int) -> None:
    """A mid-epoch resume with a loader the Trainer did not build loads the trained batches again to skip them;
    with workers, their random state then differs from the uninterrupted run's."""
    workers = getattr(loader, "num_workers", 0)
    warnings.warn(
        f"resuming in the middle of an epoch: the {skip} batches already trained are loaded again to skip them, "
        "since the training loader's sampler is not one the Trainer built (a DataLoader with a sampler of your "
        "own, use_distributed_sampler=False, or an iterable dataset) and the checkpoint holds no state of the "
        "loader's own to restore (give a stream to torchdata's StatefulDataLoader, or resume with "
        "restore_loader_state=True at the checkpoint's world size, to read on where it was)"
        + (f"; with num_workers={workers}, random augmentation in the workers then differs from an uninterrupted "
           "run" if workers else ""),
        stacklevel=3,
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
    return type(value).__name__


def _memory_metric(rank: int, kind: str, value: int) -> tuple[str, float]:
    """A memory report's entry as a logged metric: bytes in MiB, counts of elements as they are."""
    if kind.endswith("_elements"):
        return f"memory/rank{rank}/{kind}", value
    return f"memory/rank{rank}/{kind}_MiB", value / 2**20
