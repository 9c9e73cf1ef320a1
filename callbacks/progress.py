"""A tqdm progress bar on global rank 0: one bar per training epoch, a transient bar for each validation."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainModule


class ProgressBar(Callback):
    """A tqdm progress bar on rank 0: one bar per training epoch, a transient bar for each validation.

    It shows the epoch, batches done, it/s, the step loss, the optimizer step and every metric logged with
    `prog_bar=True`; ranks other than 0 show nothing. The Trainer adds one unless `enable_progress_bar=False`.
    When the output is not a terminal (CI logs, files) the bar is redrawn at most every `non_tty_interval`
    seconds so logs stay short, the final state of each epoch is always written, and validation inside an epoch
    shows no bar.

    Args:
        refresh_rate: update the bar every this many batches.
        non_tty_interval: seconds between redraws when the output is not a terminal.

    Raises:
        ValueError: if `refresh_rate < 1`.
    """

    def __init__(self, refresh_rate: int = 1, non_tty_interval: float = 10.0) -> None:
        if refresh_rate < 1:
            raise ValueError(f"ProgressBar(refresh_rate={refresh_rate}) must be an integer >= 1")
        self.refresh_rate = refresh_rate
        self.non_tty_interval = non_tty_interval
        self.train_bar: tqdm | None = None
        self.eval_bar: tqdm | None = None
        self._loss: float | None = None
        self._train_done = 0
        self._eval_done = 0
        self._is_tty = False

    def _bar(self, trainer: Trainer, total: int | None, desc: str, leave: bool) -> tqdm:
        file = sys.stderr
        is_tty = self._is_tty = bool(getattr(file, "isatty", lambda: False)())
        sized = is_tty and _columns(file) > 0  # some pseudo-terminals report a size of 0x0
        return tqdm(
            total=total or None,
            desc=desc,
            leave=leave,
            file=file,
            dynamic_ncols=sized,
            ncols=None if sized or not is_tty else 100,
            nrows=None if sized or not is_tty else 50,
            mininterval=0.1 if is_tty else self.non_tty_interval,
            # A transient bar drawn below another one needs cursor movement, which a log file cannot show.
            disable=not trainer.is_global_zero or (not leave and not is_tty),
            smoothing=0,
        )

    def _postfix(self, trainer: Trainer) -> dict[str, Any]:
        postfix: dict[str, Any] = {}
        if self._loss is not None:
            postfix["loss"] = f"{self._loss:.4g}"
        postfix["step"] = trainer.global_step
        for name, value in trainer.progress_bar_metrics.items():
            postfix[name] = f"{float(value):.4g}"
        return postfix

    # -- training -------------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._close_train_bar()
        self._loss = None
        self._train_done = 0
        desc = f"Epoch {trainer.current_epoch}"
        self.train_bar = self._bar(trainer, trainer.num_training_batches, desc, leave=True)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_bar
        self._train_done = batch_idx + 1
        if bar is None or bar.disable or (batch_idx + 1) % self.refresh_rate != 0:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._loss = loss.item()
        bar.set_postfix(self._postfix(trainer), refresh=False)
        bar.update(batch_idx + 1 - bar.n)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        bar = self.train_bar
        if bar is not None and not bar.disable:
            bar.set_postfix(self._postfix(trainer), refresh=False)
            bar.update(self._train_done - bar.n)
        self._close_train_bar()

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._close_train_bar()

    # -- validation, test, predict --------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        desc = "Sanity Checking" if trainer.sanity_checking else "Validation"
        self._open_eval_bar(trainer, trainer.num_val_batches, desc)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval_bar(batch_idx)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._close_eval_bar()
        if self.train_bar is not None and not self.train_bar.disable:
            # In a log file every refresh is a new line; the epoch's last line comes when the bar closes.
            self.train_bar.set_postfix(self._postfix(trainer), refresh=self._is_tty)

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._open_eval_bar(trainer, getattr(trainer, "num_test_batches", None), "Testing")

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval_bar(batch_idx)

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._close_eval_bar()

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._open_eval_bar(trainer, getattr(trainer, "num_predict_batches", None), "Predicting")

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval_bar(batch_idx)

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._close_eval_bar()

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        self._close_eval_bar()
        self._close_train_bar()

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._close_eval_bar()
        self._close_train_bar()

    # -- helpers --------------------------------------------------------------------------------------------
    def _open_eval_bar(self, trainer: Trainer, total: int | None, desc: str) -> None:
        self._close_eval_bar()
        self._eval_done = 0
        # Inside a training epoch the bar is transient; a standalone validate/test/predict keeps its bar.
        self.eval_bar = self._bar(trainer, total, desc, leave=self.train_bar is None)

    def _advance_eval_bar(self, batch_idx: int) -> None:
        self._eval_done = batch_idx + 1
        bar = self.eval_bar
        if bar is not None and not bar.disable and (batch_idx + 1) % self.refresh_rate == 0:
            bar.update(batch_idx + 1 - bar.n)

    def _close_eval_bar(self) -> None:
        if self.eval_bar is not None:
            if not self.eval_bar.disable:
                self.eval_bar.update(self._eval_done - self.eval_bar.n)
            self.eval_bar.close()
            self.eval_bar = None

    def _close_train_bar(self) -> None:
        if self.train_bar is not None:
            self.train_bar.close()
            self.train_bar = None


def _columns(file: Any) -> int:
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0
