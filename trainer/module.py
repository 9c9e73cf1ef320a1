"""TrainModule: the user's model plus the steps, optimizers and hooks that define how it trains."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .datamodule import DataHooks
from .hparams import AttributeDict, HyperparametersMixin
from .metric_objects import collection_items, is_collection

if TYPE_CHECKING:
    from .trainer import Trainer


class TrainModule(HyperparametersMixin, DataHooks, nn.Module):
    """Subclass it, define `training_step` and `configure_optimizers`, and hand it to `Trainer.fit`."""

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams = AttributeDict()
        self.automatic_optimization = True  # False: training_step steps the optimizers itself (as Lightning)

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

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, strict: bool = True, **overrides: Any) -> Any:
        """The module rebuilt from the hyperparameters a checkpoint recorded (`save_hyperparameters`; `overrides`
        replace some) with its weights loaded, in this process: from any strategy's checkpoint or full file."""
        from .checkpoint import load_full_state_dict, load_trainer_state

        saved = load_trainer_state(checkpoint_path)
        module = cls(**{**saved.get("hparams", {}), **overrides})
        module.configure_model()
        module.load_state_dict(load_full_state_dict(checkpoint_path), strict=strict)
        return module

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
        reduce_fx: Any = "mean",
        logger: bool = True,
        rank_zero_only: bool = False,
    ) -> None:
        """Log a metric. In training steps it defaults to per step; in validation and test, and in epoch-end hooks,
        to per epoch: the mean over the epoch's steps weighted by batch size (inferred from the batch, or
        `batch_size`). `sync_dist=True` averages over the ranks too, so that the epoch value is one process's mean
        over the samples. `value` may be a torchmetrics Metric: per step its value for the batch, per epoch its
        compute() (synced by the metric itself), after which it is reset.
        `reduce_fx`: "mean", "sum", "max" or "min" (or torch's function) over the epoch (and ranks); `logger=False`:
        only in callback_metrics and the progress bar; `rank_zero_only=True`: logged from rank 0 alone (no sync)."""
        self.trainer.metrics.log(
            name, value, prog_bar=prog_bar, on_step=on_step, on_epoch=on_epoch, sync_dist=sync_dist,
            batch_size=batch_size, reduce_fx=reduce_fx, logger=logger, rank_zero_only=rank_zero_only,
        )

    def log_dict(self, metrics: Any, **kwargs: Any) -> None:
        """`self.log` of each entry of a dict, or of each metric of a torchmetrics MetricCollection."""
        for name, value in collection_items(metrics) if is_collection(metrics) else metrics.items():
            self.log(name, value, **kwargs)

    # ---- manual optimization (self.automatic_optimization = False) ----------------------------------
    def optimizers(self) -> Any:
        """The optimizer configure_optimizers returned (a list when it returned several), set up by the strategy:
        its step() and zero_grad() drive the engine and count global_step."""
        optimizers = self.trainer.optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The scheduler (a list when there are several; None without): under manual optimization step them."""
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor) -> None:
        """loss.backward() with the precision's loss scaling, between the on_before/after_backward hooks."""
        self.trainer.backward(loss)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients of `optimizer`'s parameters (across ranks and shards): by their global norm
        ("norm", default) or each element ("value")."""
        self.trainer.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Only `optimizer`'s parameters require gradients until untoggle_optimizer (as Lightning, for GANs)."""
        own = {id(p) for p in self.trainer.strategy.optimizer_parameters(optimizer)}
        self._toggled = {p: p.requires_grad for p in self.parameters()}
        for p in self.parameters():
            p.requires_grad_(id(p) in own and self._toggled[p])

    def untoggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for p, requires_grad in getattr(self, "_toggled", {}).items():
            p.requires_grad_(requires_grad)
        self._toggled = {}

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

    # ---- hooks, where Lightning calls them ---------------------------------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
