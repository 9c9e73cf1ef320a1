"""One training batch, as plain torch reads it: `training_step`, `loss.backward()`, clipping, `optimizer.step()`,
`optimizer.zero_grad()`, with the callback hooks between; the strategy's engine works from hooks on the model and
the optimizer. Gradients accumulate over `accumulate_grad_batches` batches (a window) before one optimizer step.

After each training_step the ranks agree, in one small all-reduce (agreement.py), on what only some of them may
know: a skipped batch, a non-finite loss, a SIGTERM, training data that ran out, max_time passed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from ..data.uneven import Lookahead
from ..evaluation.evaluate import log_metrics, to_step
from ..evaluation.pipeline_steps import log_all, per_step, recorded_logs
from .agreement import Agreement, agree
from .nonfinite import nonfinite_losses
from .optimizers import check_closure_step, needs_closure, step_schedulers

if TYPE_CHECKING:
    from ..trainer import Trainer


class TrainingClock:
    """Seconds trained, over resumes too (max_time counts them, as Lightning's Timer does)."""

    def __init__(self) -> None:
        self._before, self._started = 0.0, time.monotonic()

    def start(self, elapsed_before: float) -> None:
        self._before, self._started = elapsed_before, time.monotonic()

    def elapsed(self) -> float:
        return self._before + time.monotonic() - self._started


class TrainingBatch:
    """Runs one training batch after another, and the optimizer step that ends each accumulation window."""

    def __init__(self, trainer: Trainer, clock: TrainingClock) -> None:
        self.trainer, self.strategy, self.module = trainer, trainer.strategy, trainer.module
        self.optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.clock = clock
        self.agreed = Agreement()  # the ranks' agreement after the latest training_step
        self.batches: Any = None  # this epoch's training batches (a Lookahead knows whether this rank has another)
        self.stop_requested = False  # the ranks agreed to stop on a signal; this optimizer step is done
        self.out_of_time = False  # the ranks agreed that max_time has passed; this optimizer step is done
        self._backward_in_window = False
        self._unsynced = False  # the window's gradients await the reduction no_sync held back
        self._skip_window = False  # a non-finite loss in this accumulation window (on_nonfinite="skip")
        self.steps_with_closure = bool(
            self.module.automatic_optimization and self.optimizer is not None and needs_closure(self.optimizer)
        )
        if self.steps_with_closure:
            check_closure_step(self.optimizer, trainer.accumulate_grad_batches, trainer.precision.scaler)
        if self.strategy.pipeline is not None:
            check_pipeline_step(self.module, trainer.precision.scaler, self.steps_with_closure)

    def run(self, batch: Any, batch_idx: int) -> None:
        t = self.trainer
        batch = to_step(t, batch)
        t._call("on_train_batch_start", batch, batch_idx)
        if self.steps_with_closure:  # training_step runs inside optimizer.step (LBFGS)
            self._end_batch(self._step_with_closure(batch, batch_idx), batch, batch_idx)
            return
        if self.strategy.pipeline is not None:  # the schedule runs forward and backward (pipeline_parallel.py)
            self._end_batch(self._pipeline_batch(batch, batch_idx), batch, batch_idx)
            return
        with t.timer.phase("forward"), t.precision.autocast(), self.strategy.forward_context():
            output = self.module.training_step(batch, batch_idx)
        if not self.module.automatic_optimization:  # training_step did backward and the steps itself
            outputs = self._manual_outputs(output, batch_idx)
        else:
            loss = self._loss_from(output, batch_idx)
            loss = loss if loss is None else self.strategy.weigh_loss(loss)  # (its share of a split sequence)
            value = loss.full_tensor() if isinstance(loss, DTensor) else loss  # (loss_parallel's DTensor)
            agreed = self._agree(value, batch_idx)
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
                outputs = {"loss": value.detach()}
            if window_end:
                self._optimizer_step(batch_idx)
                self.stop_requested, self.out_of_time = agreed.stop, agreed.out_of_time
        self._end_batch(outputs, batch, batch_idx)

    def _pipeline_batch(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor] | None:
        """A batch through the pipeline's stages: the schedule runs every micro-batch's forward and backward
        (the module's pipeline_loss on the last stage), gradients accumulate unsynced until the window's end;
        the loss and what pipeline_loss logged come from the last stage to every rank of the pipeline."""
        t = self.trainer
        with t.timer.phase("forward"), t.precision.autocast(), recorded_logs(self.module) as records:
            with self.strategy.no_backward_sync():
                loss = self.strategy.pipeline_step(batch, 1.0 / t.accumulate_grad_batches)
        loss, logged = self.strategy.from_last_stage((loss, per_step(records)))
        value = loss.to(self.strategy.root_device)
        log_all(self.module, logged)
        agreed = self._agree(value, batch_idx)
        self._backward_in_window, self._unsynced = True, True  # (synchronised before the optimizer step)
        window_end = (
            (batch_idx + 1) % t.accumulate_grad_batches == 0
            or batch_idx + 1 == t.num_training_batches
            or agreed.last_batch
        )
        if window_end:
            self._optimizer_step(batch_idx)
            self.stop_requested, self.out_of_time = agreed.stop, agreed.out_of_time
        return None if agreed.skip else {"loss": value}

    def _end_batch(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        t = self.trainer
        t.state.batches_done_in_epoch = batch_idx + 1  # before the hook: a checkpoint saved there resumes after it
        t.state.epoch_complete = batch_idx + 1 >= t.num_training_batches or self.agreed.last_batch
        t.state.time_elapsed = self.clock.elapsed()
        t._call("on_train_batch_end", outputs, batch, batch_idx)

    def _step_with_closure(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        """An optimizer whose step evaluates the loss itself, once or several times (LBFGS): as Lightning does,
        training_step and backward (and clipping) run in the closure `optimizer.step(closure)` calls, as a plain
        torch loop writes it. The closure returns the loss averaged over the data-parallel ranks, the global
        batch's loss that one process would see, so every rank's line search decides alike. What training_step
        logs is from its first evaluation: the loss at the weights the step starts from."""
        t = self.trainer
        losses: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            with _logging_off(self.module) if losses else nullcontext(), t.timer.phase("forward"):
                with t.precision.autocast(), self.strategy.forward_context():
                    output = self.module.training_step(batch, batch_idx)
            loss = self._loss_from(output, batch_idx)
            if loss is None:
                raise ValueError(
                    f"training_step returned None (batch {batch_idx}), but {type(self.optimizer).__name__} "
                    "evaluates the loss in its step and cannot skip a batch"
                )
            loss = self.strategy.weigh_loss(loss)
            t.backward(loss)
            if t.gradient_clip_val is not None:
                self.strategy.clip_gradients(t.gradient_clip_val, algorithm=t.gradient_clip_algorithm)
            losses.append(self.strategy.average_over_data(loss))
            return losses[-1]

        with t.timer.phase("optimizer"):
            t._call("on_before_optimizer_step", self.optimizer)
            self.optimizer.step(closure)
            t._call("on_before_zero_grad", self.optimizer)
            self.optimizer.zero_grad()
        agreed = self._agree(None, batch_idx)  # a signal, data that ran out (the loss is the line search's)
        self.stop_requested, self.out_of_time = agreed.stop, agreed.out_of_time
        t.state.global_step += 1
        step_schedulers(t, "step", t.global_step)
        self._log_step_metrics()
        return {"loss": losses[0]}

    def _manual_outputs(self, output: Any, batch_idx: int) -> Any:
        """Manual optimization: the ranks still agree on a signal or data that ran out; global_step counts the
        optimizer steps training_step took (trainer/trainer.py counts them)."""
        agreed = self._agree(None, batch_idx)  # no loss to check
        self.stop_requested, self.out_of_time = agreed.stop, agreed.out_of_time
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
        has_next = self.batches.has_next if isinstance(self.batches, Lookahead) else True
        stop = t.signal_watch.received is not None
        late = t.max_time is not None and self.clock.elapsed() >= t.max_time.total_seconds()
        self.agreed = agree(self.strategy, loss, t.nonfinite.checks, stop, has_next, self._where(batch_idx), late)
        if self.agreed.nonfinite_loss and not self._skip_window:  # a window counts once
            self._nonfinite(f"loss ({nonfinite_losses(self.strategy, loss)})", batch_idx)
            self._skip_window = True
        return self.agreed

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
            log_metrics(t, {**step_metrics, **t.timer.window_metrics()})  # time/*: where this window's steps went

    def _clip_gradients(self, batch_idx: int) -> bool:
        """Clip by the global norm; False to skip the step when that norm is not finite (on_nonfinite="skip").
        The norm is the same on every rank, so they all decide alike."""
        t = self.trainer
        norm = self.strategy.clip_gradients(t.gradient_clip_val, algorithm=t.gradient_clip_algorithm)
        if norm is not None and t.nonfinite.checks and not torch.isfinite(norm):
            self._nonfinite(f"gradient norm ({float(norm)}, over every rank)", batch_idx)
            return False
        return True


def check_pipeline_step(module: Any, scaler: Any, with_closure: bool) -> None:
    """What a pipeline's schedule cannot run: it owns forward and backward, so training_step's own backward
    (manual optimization), a loss scaler's scaling (16-mixed) and a step that evaluates the loss itself (LBFGS)."""
    if not module.automatic_optimization:
        raise ValueError(
            "pipeline_parallel_size > 1 with manual optimization: the pipeline's schedule runs forward and backward "
            "itself; use automatic optimization (the module's pipeline_loss gives the loss)"
        )
    if scaler is not None:
        raise ValueError(
            'precision="16-mixed" with pipeline_parallel_size > 1: the loss scaling is not applied inside the '
            'pipeline\'s schedule; use precision="bf16-mixed" (no scaling needed) or "32"'
        )
    if with_closure:
        raise ValueError(
            "pipeline_parallel_size > 1 with an optimizer that evaluates the loss in its step (LBFGS): choose "
            "another optimizer, or train without a pipeline"
        )


@contextmanager
def _logging_off(module: Any) -> Iterator[None]:
    """`self.log` does nothing inside (a closure's later evaluations of the same batch)."""
    module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
    return type(value).__name__
