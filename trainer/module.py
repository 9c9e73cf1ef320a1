"""TrainModule: the user's model plus the steps, optimizers and hooks that define how it trains."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .hparams import AttributeDict
from .hparams import collect as collect_hparams

if TYPE_CHECKING:
    from .trainer import Trainer


class TrainModule(nn.Module):
    """Subclass it, define `training_step` and `configure_optimizers`, and hand it to `Trainer.fit`."""

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams = AttributeDict()

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer; call trainer.fit(module) first"
            )
        return self._trainer

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch

    @property
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device if self._trainer else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self.trainer.global_rank if self._trainer else 0

    @property
    def local_rank(self) -> int:
        return self.trainer.local_rank if self._trainer else 0

    def save_hyperparameters(self, *args: Any, ignore: Any = None, **hparams: Any) -> None:
        """Record hyperparameters (logged to TensorBoard, saved in checkpoints, used by `load_from_checkpoint`).
        With no arguments, every argument `__init__` was called with (as Lightning); or the named ones
        (`save_hyperparameters("lr", "hidden")`), one dict or Namespace, or keywords. `ignore`: names to leave out."""
        frame = inspect.currentframe().f_back
        try:
            self.hparams.update(collect_hparams(frame, self, args, ignore, hparams))
        finally:
            del frame

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Every rank's tensors (a tensor or any tree of them), stacked along a new first dimension of the world
        size. With `sync_grads` the gather is differentiable (each rank gets the gradient of its own part)."""
        return self.trainer.strategy.all_gather(data, sync_grads=sync_grads)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Log a metric. In training it defaults to per step; in validation and test to per epoch: the mean over
        the epoch's steps weighted by batch size (inferred from the batch, or `batch_size`). `sync_dist=True`
        averages over the ranks too, so that the epoch value is one process's mean over the samples."""
        self.trainer.metrics.log(
            name, value, prog_bar=prog_bar, on_step=on_step, on_epoch=on_epoch, sync_dist=sync_dist,
            batch_size=batch_size,
        )

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ---- what the user defines ----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define training_step(self, batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define validation_step to validate")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define test_step to test")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def configure_model(self) -> None:
        """Build large layers here: it runs under the strategy's init context."""

    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    # ---- hooks --------------------------------------------------------------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
