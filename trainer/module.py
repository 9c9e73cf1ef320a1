"""TrainModule: the user's model plus the steps, optimizers and hooks that define how it trains."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .datamodule import DataHooks
from .evaluation.metric_objects import collection_items, is_collection
from .hparams import AttributeDict, HyperparametersMixin

if TYPE_CHECKING:
    from .trainer import Trainer


class TrainModule(HyperparametersMixin, DataHooks, nn.Module):
    """The model to train, with the steps, optimizers and hooks that say how it trains (Lightning's
    `LightningModule`).

    A `TrainModule` is an `nn.Module`. Subclass it, define `training_step` and `configure_optimizers` (and
    `validation_step`, `test_step`, `predict_step` to evaluate), and hand it to `Trainer.fit`. Set
    `self.automatic_optimization = False` in `__init__` to step the optimizers yourself in `training_step`
    (with `optimizers()`, `manual_backward` and `lr_schedulers()`).

    Example:
        ```python
        class Classifier(TrainModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(32, 10)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.cross_entropy(self.net(x), y)
                self.log("train_loss", loss)
                return loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self.hparams = AttributeDict()
        self.automatic_optimization = True  # False: training_step steps the optimizers itself (as Lightning)

    @property
    def trainer(self) -> Trainer:
        """The `Trainer` this module is being run by.

        Raises:
            RuntimeError: if the module was not given to a Trainer's `fit` (or `validate`, `test`, `predict`).
        """
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call trainer.fit(module) first")
        return self._trainer

    @property
    def global_step(self) -> int:
        """The Trainer's `global_step`: optimizer steps taken so far."""
        return self.trainer.global_step

    @property
    def current_epoch(self) -> int:
        """The Trainer's `current_epoch`, counted from 0."""
        return self.trainer.current_epoch

    @property
    def device(self) -> torch.device:
        """The device of this rank (CPU before the module is attached to a Trainer)."""
        return self.trainer.strategy.root_device if self._trainer else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        """This process's rank among all ranks (0 without a Trainer)."""
        return self.trainer.global_rank if self._trainer else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (0 without a Trainer)."""
        return self.trainer.local_rank if self._trainer else 0

    @property
    def device_mesh(self) -> Any:
        """The strategy's 2-D mesh of the ranks, dimensions "data_parallel" and "tensor_parallel" (as in
        Lightning's ModelParallelStrategy): in `configure_model`, apply torch's tensor parallel on
        `self.device_mesh["tensor_parallel"]`. See docs/strategies.md, "Tensor parallel"."""
        return self.trainer.strategy.device_mesh

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: str | os.PathLike, strict: bool = True, trust_pickled: bool = False, **overrides: Any
    ) -> Any:
        """Rebuild the module from a checkpoint, in this process, with no process group.

        The module is constructed with the hyperparameters the checkpoint recorded (see `save_hyperparameters`),
        then `configure_model` runs and the weights are loaded. Works with a checkpoint of any strategy and world
        size, directory or full file.

        Args:
            checkpoint_path: a checkpoint directory or full file this project wrote.
            strict: passed to `load_state_dict`: whether the checkpoint's keys must match the module's exactly.
            trust_pickled: unpickle whatever the checkpoint holds, not only tensors and plain data (only for a
                checkpoint whose writer you trust: unpickling can run code).
            **overrides: constructor arguments that replace recorded hyperparameters.

        Returns:
            The module, with the checkpoint's weights loaded.
        """
        from .checkpoint import load_full_state_dict, load_trainer_state

        saved = load_trainer_state(checkpoint_path, trust_pickled=trust_pickled)
        module = cls(**{**saved.get("hparams", {}), **overrides})
        module.configure_model()
        module.load_state_dict(load_full_state_dict(checkpoint_path, trust_pickled=trust_pickled), strict=strict)
        return module

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print(*args, **kwargs)` on rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Gather every rank's tensors, stacked along a new first dimension of size `world_size`.

        Collective: call it on every rank.

        Args:
            data: a tensor, or any tree (dicts, lists, tuples) of tensors.
            sync_grads: make the gather differentiable (each rank gets the gradient of its own part).

        Returns:
            `data`'s structure with each tensor gathered.
        """
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
        """Log a metric: to the loggers, to `trainer.callback_metrics` and, with `prog_bar`, to the progress bar.

        In training steps a value is logged per step by default; in validation and test steps and in epoch-end
        hooks, per epoch: reduced over the epoch's steps (the mean is weighted by batch size).

        Args:
            name: the metric's name.
            value: a number, a scalar tensor, or a torchmetrics `Metric` (per step its value for the batch, per
                epoch its `compute()`, synced by the metric itself, after which it is reset).
            prog_bar: also show it in the progress bar.
            on_step: log the value of each step; `None` for the default of where `log` is called.
            on_epoch: log the epoch's reduced value; `None` for the default of where `log` is called.
            sync_dist: reduce over the ranks too, so that the epoch value is that of all samples.
            batch_size: the batch size that weighs the epoch mean; `None` to infer it from the batch.
            reduce_fx: how values are reduced over the epoch (and ranks): `"mean"`, `"sum"`, `"max"`, `"min"`, or
                torch's function of that name.
            logger: write it to the loggers; `False` keeps it in `callback_metrics` and the progress bar only.
            rank_zero_only: logged from rank 0 alone, without a sync.

        Raises:
            RuntimeError: if the module is not attached to a Trainer.
        """
        if isinstance(value, torch.Tensor) and not rank_zero_only:  # a part of split sequences: the whole's
            value = self.trainer.strategy.combine_sequence_parts(value)
        self.trainer.metrics.log(
            name,
            value,
            prog_bar=prog_bar,
            on_step=on_step,
            on_epoch=on_epoch,
            sync_dist=sync_dist,
            batch_size=batch_size,
            reduce_fx=reduce_fx,
            logger=logger,
            rank_zero_only=rank_zero_only,
        )

    def sequence_dims(self, batch: Any) -> Any:
        """Under context parallel (`context_parallel_size` > 1): which dimension of each tensor of `batch` is the
        sequence that the Trainer splits over the context-parallel ranks. Return the batch's structure (dicts,
        lists, tuples alike) with an int for each tensor to split and None for each to keep whole, e.g.
        `{"input_ids": 1, "labels": 1, "image": None}`; or None (the default) for the rule: dimension 1 of every
        tensor of two or more dimensions whose size there is the sequence's (that of the first such tensor).

        Args:
            batch: the batch, on the device.

        Returns:
            The sequence dimensions, or None.
        """
        return None

    def log_dict(self, metrics: Any, **kwargs: Any) -> None:
        """Call `self.log` for each entry of a dict, or each metric of a torchmetrics `MetricCollection`.

        Args:
            metrics: a dict of name to value, or a `MetricCollection`.
            **kwargs: `log`'s other arguments, for every entry.
        """
        for name, value in collection_items(metrics) if is_collection(metrics) else metrics.items():
            self.log(name, value, **kwargs)

    # ---- manual optimization (self.automatic_optimization = False) ----------------------------------
    def optimizers(self) -> Any:
        """The optimizer `configure_optimizers` returned, set up by the strategy (for manual optimization).

        Its `step()` and `zero_grad()` drive the strategy's engine, and each `step()` counts in `global_step`.

        Returns:
            The optimizer, or a list when `configure_optimizers` returned several.
        """
        optimizers = self.trainer.optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The learning-rate scheduler(s) `configure_optimizers` returned; under manual optimization, step them
        yourself.

        Returns:
            The scheduler, a list when there are several, or None without one.
        """
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's hook: how the Trainer runs backward on the (scaled) loss, between `on_before_backward` and
        `on_after_backward`. Override it to run backward in a context, such as torch's `loss_parallel()` under
        tensor parallel (docs/strategies.md, "Tensor parallel").

        Args:
            loss: the loss tensor, scaled by the precision.
        """
        loss.backward(*args, **kwargs)

    def manual_backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` with the precision's loss scaling, between the `on_before_backward` and
        `on_after_backward` hooks. Use it instead of `loss.backward()` under manual optimization.

        Args:
            loss: the loss tensor.
        """
        self.trainer.backward(loss)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of `optimizer`'s parameters (across ranks and shards); for manual optimization.

        Args:
            optimizer: one of `optimizers()`.
            gradient_clip_val: the clipping value; `None` for the Trainer's `gradient_clip_val` (no clipping when
                that is `None` too).
            gradient_clip_algorithm: `"norm"` (the global norm) or `"value"` (each element); `None` for the
                Trainer's.

        Raises:
            ValueError: for a non-positive `gradient_clip_val` or an unknown `gradient_clip_algorithm`.
        """
        self.trainer.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make only `optimizer`'s parameters require gradients, until `untoggle_optimizer` (as Lightning, for
        GANs).

        Args:
            optimizer: one of `optimizers()`.
        """
        own = {id(p) for p in self.trainer.strategy.optimizer_parameters(optimizer)}
        self._toggled = {p: p.requires_grad for p in self.parameters()}
        for p in self.parameters():
            p.requires_grad_(id(p) in own and self._toggled[p])

    def untoggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Restore the `requires_grad` flags that `toggle_optimizer` changed.

        Args:
            optimizer: the optimizer given to `toggle_optimizer` (not used otherwise).
        """
        for p, requires_grad in getattr(self, "_toggled", {}).items():
            p.requires_grad_(requires_grad)
        self._toggled = {}

    # ---- what the user defines ----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute the loss of one training batch. Must be defined.

        Args:
            batch: the batch from the training loader, on this rank's device.
            batch_idx: the batch's index in the epoch.

        Returns:
            A scalar loss tensor that requires grad, a dict with a `"loss"` entry, or `None` to skip the batch.
            Under manual optimization the return value is not used for a backward pass.

        Raises:
            NotImplementedError: if the subclass does not define it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define training_step(self, batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one validation batch, usually logging metrics with `self.log`. Runs under `torch.no_grad()`.
        Without it, `fit` does not validate.

        Args:
            batch: the batch from the validation loader.
            batch_idx: the batch's index.

        Raises:
            NotImplementedError: if the subclass does not define it (and `validate` is called).
        """
        raise NotImplementedError(f"{type(self).__name__} must define validation_step to validate")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one test batch, usually logging metrics with `self.log`. Runs under `torch.no_grad()`.

        Args:
            batch: the batch from the test loader.
            batch_idx: the batch's index.

        Raises:
            NotImplementedError: if the subclass does not define it (and `test` is called).
        """
        raise NotImplementedError(f"{type(self).__name__} must define test_step to test")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """The prediction of one batch for `Trainer.predict`; by default `self(batch)`.

        Args:
            batch: the batch from the predict loader.
            batch_idx: the batch's index.

        Returns:
            The prediction.
        """
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Create the optimizers (and learning-rate schedulers). Must be defined (unless training is not run).

        Returns:
            An optimizer; a list of optimizers; `([optimizers], [schedulers])`; a dict
            `{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "epoch" | "step",
            "frequency": ..., "monitor": ...}}`; or a list of such dicts. A `ReduceLROnPlateau` needs a
            `monitor`.

        Raises:
            NotImplementedError: if the subclass does not define it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def configure_model(self) -> None:
        """Build large layers here rather than in `__init__`.

        It runs once, under the strategy's init context: with FSDP the weights are created on the meta device
        and materialized shard by shard, so a model larger than one device's memory can be built. The default
        does nothing.
        """

    def tensor_parallel_plan(self) -> dict[str, Any] | None:
        """The tensor-parallel plan `configure_model` gives torch's `parallelize_module` when
        `self.device_mesh["tensor_parallel"]` has more than one rank, its paths under this module (e.g.
        `{f"model.{path}": style for path, style in examples.llama.tensor_parallel_plan().items()}`); None (the
        default) when the module is not split. `trainer.plan` lays each rank's share out by it, and
        `strategy="auto"` tries tensor-parallel sizes by it when no strategy fits without. It does not split the
        module: `configure_model` does."""
        return None

    # ---- hooks, where Lightning calls them ---------------------------------------------------------
    def on_fit_start(self) -> None:
        """Called at the start of `fit`, after the strategy is set up, on every rank."""

    def on_fit_end(self) -> None:
        """Called at the end of `fit`."""

    def on_train_start(self) -> None:
        """Called when training starts, after the sanity check."""

    def on_train_end(self) -> None:
        """Called when training ends."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch; values logged here are per epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called before `training_step`.

        Args:
            batch: the batch `training_step` gets.
            batch_idx: its index in the epoch.
        """

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch (micro-batch, under gradient accumulation).

        Args:
            outputs: what `training_step` returned.
            batch: the batch.
            batch_idx: its index in the epoch.
        """

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Called before the backward pass.

        Args:
            loss: the loss, already scaled by the precision if it scales (`"16-mixed"`).
        """

    def on_after_backward(self) -> None:
        """Called after the backward pass; `.grad` is set for every parameter that got a gradient."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before `optimizer.step()`, before gradient clipping (as Lightning).

        Args:
            optimizer: the optimizer about to step.
        """

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before `optimizer.zero_grad()`.

        Args:
            optimizer: the optimizer whose gradients are about to be zeroed.
        """

    def on_validation_start(self) -> None:
        """Called when a validation run starts."""

    def on_validation_end(self) -> None:
        """Called when a validation run ends."""

    def on_validation_epoch_start(self) -> None:
        """Called at the start of a validation epoch."""

    def on_validation_epoch_end(self) -> None:
        """Called at the end of a validation epoch; values logged here are per epoch."""

    def on_test_start(self) -> None:
        """Called when testing starts."""

    def on_test_end(self) -> None:
        """Called when testing ends."""

    def on_test_epoch_start(self) -> None:
        """Called at the start of the test epoch."""

    def on_test_epoch_end(self) -> None:
        """Called at the end of the test epoch; values logged here are per epoch."""

    def on_predict_start(self) -> None:
        """Called when prediction starts."""

    def on_predict_end(self) -> None:
        """Called when prediction ends."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Called on rank 0 when a checkpoint is saved: add entries to `checkpoint` to save them with it.

        Unlike Lightning, `checkpoint` is not the whole checkpoint but a dict of additions (empty at first, and
        shared with the callbacks' `on_save_checkpoint`); `on_load_checkpoint` gets it back.

        Args:
            checkpoint: the dict of additions, to fill in.
        """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Called when a checkpoint is loaded, with the dict that `on_save_checkpoint` filled in.

        Args:
            checkpoint: the module's additions saved with the checkpoint.
        """
