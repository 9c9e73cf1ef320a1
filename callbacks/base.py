"""The `Callback` contract: hooks the Trainer calls at loop events. Every hook is a no-op here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

    from trainer import Trainer, TrainModule


class Callback:
    """Reacts to loop events. Subclasses override the hooks they need; names and signatures follow Lightning.

    Every hook gets the `Trainer` and the `TrainModule` as its first two arguments, and runs on every rank unless
    its description says otherwise. Pass callbacks to `Trainer(callbacks=[...])`.

    A callback that keeps state across a resume returns it from `state_dict` (plain Python values) and takes
    it back in `load_state_dict`. The Trainer stores it under `checkpoint["callbacks"][callback.state_key]`.
    State as large as the weights (an average of them, say) goes through `sharded_state` and
    `sharded_state_targets` instead: each rank writes and reads only its own pieces of it.
    """

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; unique among the callbacks of one Trainer."""
        return type(self).__qualname__

    def _generate_state_key(self, **kwargs: Any) -> str:
        """A state key that includes the arguments telling two instances of one class apart."""
        return f"{type(self).__qualname__}{kwargs!r}"

    def state_dict(self) -> dict[str, Any]:
        """The state to keep across a resume (plain Python values); the default is an empty dict."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what `state_dict` returned, when a checkpoint is loaded.

        Args:
            state_dict: the dict `state_dict` returned when the checkpoint was saved.
        """

    # -- whole runs -----------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        """Called at the start of fit/validate/test/predict on every rank, after the strategy is set up.

        Args:
            stage: `"fit"`, `"validate"`, `"test"` or `"predict"`.
        """

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        """Called at the end of fit/validate/test/predict on every rank.

        Args:
            stage: `"fit"`, `"validate"`, `"test"` or `"predict"`.
        """

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of `fit`, after the strategy is set up."""

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of `fit`."""

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        """Called when `fit`, `validate`, `test` or `predict` fails, before the error propagates.

        Args:
            trainer: the Trainer.
            module: the TrainModule.
            exception: the error.
        """

    # -- training -------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when training starts, after the sanity check."""

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when training ends."""

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of each training epoch."""

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        """Called before `training_step` with its `batch` and `batch_idx`.

        Args:
            batch: the batch.
            batch_idx: the batch's index in the epoch.
        """

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Called after every micro-batch; on the last one of a step, after the optimizer step and after
        `global_step` was incremented.

        Args:
            outputs: what the step returned.
            batch: the batch.
            batch_idx: the batch's index in the epoch.
        """

    def on_before_backward(self, trainer: Trainer, module: TrainModule, loss: torch.Tensor) -> None:
        """Called before the backward pass with the loss (already scaled by the precision, if it scales).

        Args:
            loss: the loss tensor.
        """

    def on_after_backward(self, trainer: Trainer, module: TrainModule) -> None:
        """After backward, before clipping; see README for what `.grad` holds here under each strategy."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainModule, optimizer: Optimizer) -> None:
        """Before clipping and the optimizer step (as Lightning).

        Args:
            optimizer: the optimizer about to step.
        """

    def on_before_zero_grad(self, trainer: Trainer, module: TrainModule, optimizer: Optimizer) -> None:
        """Called before `optimizer.zero_grad()`.

        Args:
            optimizer: the optimizer whose gradients are about to be zeroed.
        """

    def on_sanity_check_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the sanity-check validation batches that `fit` runs first."""

    def on_sanity_check_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the sanity check."""

    # -- validation -----------------------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when a validation run starts."""

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after validation, once its epoch metrics are in `trainer.callback_metrics`."""

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of a validation epoch."""

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of a validation epoch."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each validation batch with `validation_step`'s `outputs`.

        Args:
            outputs: what the step returned.
            batch: the batch.
            batch_idx: the batch's index in the epoch.
            dataloader_idx: the loader's index (always 0: one loader per stage).
        """

    # -- test -----------------------------------------------------------------------------------------------
    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when testing starts."""

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when testing ends."""

    def on_test_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of the test epoch."""

    def on_test_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of the test epoch."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each test batch with `test_step`'s `outputs`.

        Args:
            outputs: what the step returned.
            batch: the batch.
            batch_idx: the batch's index in the epoch.
            dataloader_idx: the loader's index (always 0: one loader per stage).
        """

    # -- predict --------------------------------------------------------------------------------------------
    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when prediction starts."""

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called when prediction ends."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after each predict batch with `predict_step`'s `outputs`.

        Args:
            outputs: what the step returned.
            batch: the batch.
            batch_idx: the batch's index in the epoch.
            dataloader_idx: the loader's index (always 0: one loader per stage).
        """

    # -- checkpoints ----------------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        """Called on rank 0 when a checkpoint is saved: add entries to `checkpoint` to save them with it.

        `checkpoint` is not the whole checkpoint but a dict of additions shared with the module's
        `on_save_checkpoint`; for the callback's own state, use `state_dict`.

        Args:
            trainer: the Trainer.
            module: the TrainModule.
            checkpoint: the dict of additions, to fill in.
        """

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        """Called when a checkpoint is loaded, with the dict of additions `on_save_checkpoint` filled in.

        Args:
            trainer: the Trainer.
            module: the TrainModule.
            checkpoint: the additions saved with the checkpoint.
        """

    def sharded_state(self, trainer: Trainer) -> dict[str, dict[str, Any]]:
        """What this rank writes of state sharded like the weights (an average of them, say).

        Called on every rank at every save; nothing is gathered. Entries are stored as `"<key>.<name>"` beside
        `"model.<name>"`.

        Returns:
            `{key: {name: FlatPieces, or a tensor written whole}}`; keys other than `model`, `optim*`, `trainer`,
            `rng` and `meta`.
        """
        return {}

    def sharded_state_targets(
        self, trainer: Trainer, saved: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, Any]]:
        """Where this rank reads its sharded state back from a checkpoint being loaded.

        `FlatPieces` are read resharded (any strategy, any world size). Called on every rank, before
        `load_state_dict` and `setup`; the targets are filled once every callback answered.

        Args:
            saved: what the checkpoint holds besides the model and optimizers: `{key: {name: meta tensor}}`,
                with the saved shapes and dtypes.

        Returns:
            The targets, keyed as `sharded_state` keys them: `{key: {name: FlatPieces or tensor}}`.
        """
        return {}
